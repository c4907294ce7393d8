"""The adapter contract: every member an adapter and a case body may provide, declared once and checked on load.

The host never asks an adapter or a case body whether it has a member by name. Each member is declared here,
required or optional, with its parameters and, where optional, the host's default; `Spec.bind` checks an object
against the declaration (a required member missing, a public member no declaration names, parameters that differ)
and returns a `Bound` view on which every declared member exists. The registry binds each adapter when it loads
it and refuses one that breaks a rule, in one line naming the adapter, the member and the rule; the skeleton binds
each case body the same way.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable


class ContractError(ValueError):
    """An adapter or case body that breaks the contract; the message names it, the member and the rule."""


@dataclass(frozen=True)
class Member:
    """One declared member. `params`: a method's parameter names (after self), in order; None for an attribute.
    `default`: for an optional member, what the host uses where it is absent (for a method, called with the
    bound object's `who` and the method's arguments; for an attribute, the value)."""
    name: str
    params: tuple[str, ...] | None = ()
    required: bool = True
    default: Any = None

    def rule(self) -> str:
        if self.params is None:
            return "an attribute"
        return f"a method ({', '.join(self.params) or 'no parameters'})"


def _parameter_problem(member: Member, value) -> str | None:
    """Why `value` does not fit `member`'s declaration; None when it fits. The host calls a method with the
    declared parameters by position: it must take that many positionally (its own names for them are its own),
    and any more it takes must have defaults."""
    if member.params is None:
        return "must be an attribute, not a method" if callable(value) else None
    if not callable(value):
        return f"must be {member.rule()}, not {type(value).__name__}"
    try:
        found = list(inspect.signature(value).parameters.values())
    except (TypeError, ValueError):
        return None  # a builtin whose signature Python cannot read: taken on trust
    if any(p.kind is p.VAR_POSITIONAL for p in found):
        return None
    positional = [p for p in found if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if len(positional) < len(member.params) or len(required) > len(member.params):
        took = ", ".join(p.name for p in positional) or "no parameters"
        return f"must be {member.rule()}; it takes ({took})"
    return None


def declared(protocol: type, optional: tuple[Member, ...] = ()) -> tuple[Member, ...]:
    """The members a `typing.Protocol` class declares, every one required (its annotated attributes, then its
    methods with their parameters after self), followed by `optional`."""
    attributes = [Member(name, None) for name in protocol.__annotations__ if not name.startswith("_")]
    methods = [Member(name, tuple(list(inspect.signature(value).parameters)[1:]))
               for name, value in vars(protocol).items() if inspect.isfunction(value) and not name.startswith("_")]
    return tuple(attributes + methods) + optional


@dataclass(frozen=True)
class Spec:
    """The members one kind of object (`kind`: "adapter", "case body") may provide. `state`: the object keeps its
    own state in public attributes (a case body's model, its reference), so only what its class defines must be
    declared."""
    kind: str
    members: tuple[Member, ...]
    state: bool = False

    def problems(self, obj, who: str) -> list[str]:
        """Every rule `obj` breaks, one line each naming `who`, the member and the rule."""
        declared = {m.name for m in self.members}
        out = []
        for member in self.members:
            if not hasattr(obj, member.name):
                if member.required:
                    out.append(f"{self.kind} {who!r}: {member.name}: missing; a required member, {member.rule()}")
                continue
            problem = _parameter_problem(member, getattr(obj, member.name))
            if problem:
                out.append(f"{self.kind} {who!r}: {member.name}: {problem}")
        public = dir(type(obj) if self.state else obj)
        for name in sorted(n for n in public if not n.startswith("_") and n not in declared):
            out.append(f"{self.kind} {who!r}: {name}: not a member the contract declares "
                       f"(declared: {', '.join(sorted(declared))})")
        return out

    def bind(self, obj, who: str) -> Bound:
        """`obj` behind a view with every declared member; ContractError with its first broken rule."""
        problems = self.problems(obj, who)
        if problems:
            more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
            raise ContractError(problems[0] + more)
        return Bound(obj, self, who)


class Bound:
    """An object the contract has checked: its declared members, the host's defaults for the optional ones it
    lacks, `provides(name)` for what the host reports differently when absent, and `target`, the object itself."""

    def __init__(self, target, spec: Spec, who: str):
        self.target, self.spec, self.who = target, spec, who
        self._members = {m.name: m for m in spec.members}

    def provides(self, name: str) -> bool:
        """Whether the object itself provides the declared member `name` (a name not declared is a host bug)."""
        if name not in self._members:
            raise ContractError(f"{self.spec.kind} contract: {name!r} is not a declared member")
        return hasattr(self.target, name)

    def __getattr__(self, name: str):
        member = self.__dict__.get("_members", {}).get(name)
        if member is None:
            raise AttributeError(f"{self.spec.kind} contract: {name!r} is not a declared member")
        if hasattr(self.target, name):
            return getattr(self.target, name)
        if member.params is None:
            return member.default
        return _defaulted(member.default, self.who)

    def __repr__(self) -> str:
        return f"Bound({self.spec.kind} {self.who!r})"


def _defaulted(default: Callable, who: str) -> Callable:
    return lambda *args, **kwargs: default(who, *args, **kwargs)


def optional(name: str, params: tuple[str, ...] | None, default) -> Member:
    return Member(name, params, required=False, default=default)
