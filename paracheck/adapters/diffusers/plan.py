"""A case's plan: what every rank decides before any collective, identically (fit, route, backend, key).

Planning is pure arithmetic every rank repeats, so no rank needs to tell another whether a case runs. The
model sources (fixture factories, payloads) are loaded once per process (`Sources`), and the plan's key
names the single-device reference the case shares with every case that ends with the same fitted model.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

from paracheck.adapters.diffusers import attention
from paracheck.adapters.diffusers import library
from paracheck.adapters.diffusers.fitting import Unfittable, cp_split_problems, fit_init_dict, split_problems
from paracheck.adapters.diffusers.layout import backend_problems
from paracheck.adapters.diffusers.routes import resolve_route
from paracheck.domain.case import Case, FixtureUnavailable, call_factory
from paracheck.domain.records import Failure, FailureKind, RankStatus, Route
from paracheck.checks.traits import input_traits
from paracheck.world.recent import Recent


@dataclass(frozen=True)
class Stop:
    """Why planning ended a case before any collective: a skip, or an error raised by its source."""
    status: RankStatus
    reason: str
    failure: Failure


@dataclass
class Plan:
    """What every rank decides about a case before any collective, identically."""
    case: Case
    model_class: type | None = None
    init_dict: dict = field(default_factory=dict)
    inputs: dict = field(default_factory=dict)
    fit: list[str] = field(default_factory=list)
    route: Route | None = None
    #: The attention backend the case runs (`attention.choose`).
    attention: str | None = None
    #: Set when planning ends the case on every rank alike: a skip (it cannot run here) or an error.
    stop: Stop | None = None
    key: str | None = None
    #: What the inputs carry that known failures can be keyed on (`input_traits`).
    traits: list[str] = field(default_factory=list)


class Sources:
    """Each factory or payload a rank runs, loaded once per process (explore draws a new shape per case: the
    recent ones are kept)."""

    KEEP = 32

    def __init__(self):
        self._loaded = Recent(self.KEEP, "diffusers source")
        self._splits = Recent(self.KEEP, "diffusers cp splits")

    def get(self, case: Case):
        return self._loaded.get((case.payload or case.factory, case.variant, case.shape), lambda: _load(case))


    def splits(self, case: Case, model_class: type, init_dict: dict, inputs: dict) -> list:
        """What the class's `_cp_plan` splits in the case's call, inner entries included (`splits.plan_splits`:
        one forward on meta where the plan splits inside the model), once per source and fit."""
        from paracheck.adapters.diffusers.splits import plan_splits

        key = (case.payload or case.factory, case.variant, case.shape, json.dumps(init_dict, sort_keys=True, default=str))
        return self._splits.get(key, lambda: plan_splits(model_class, init_dict, inputs))


def _load(case: Case):
    if case.payload:
        from paracheck.adapters.diffusers.payload import load

        return load(os.path.join(case.payload, case.variant))
    return call_factory(case.factory, case.variant, case.shape)


def plan(case: Case, backend, sources: Sources) -> Plan:
    """Load the case's source, fit it, resolve its route; the same on every rank, no collective."""
    try:
        model_class, init_dict, inputs = sources.get(case)
    except FixtureUnavailable as exc:
        return Plan(case, stop=Stop(RankStatus.SKIP, str(exc), Failure(FailureKind.SKIP, exception=type(exc).__name__)))
    except Exception as exc:
        reason = f"RuntimeError: loading the model source raised {type(exc).__name__}: {exc}"
        return Plan(case, stop=Stop(RankStatus.ERROR, reason, Failure.raised(exc)))
    p = Plan(case, model_class, inputs=inputs, traits=input_traits(inputs))
    try:
        options = dict(case.cp_options)
        refused = library.cp_options_refused(case.layout, case.cp_options)
        if refused:
            raise Unfittable(refused)
        fit = fit_init_dict(model_class, init_dict, case.layout, any_heads=bool(options.get("ulysses_anything")))
        p.init_dict, p.fit = fit.init_dict, fit.changes
        p.route, p.attention = settle(case, backend, model_class, inputs,
                                      lambda: sources.splits(case, model_class, p.init_dict, inputs))
    except Unfittable as exc:
        p.stop = Stop(RankStatus.SKIP, str(exc), exc.failure)
        return p
    p.key = _key(case, model_class, p.init_dict, p.attention)
    return p


def settle(case: Case, backend, model_class: type, inputs: dict, splits=None) -> tuple[Route, str]:
    """What a fitted case runs through, (route, attention backend), decided alike on every rank; `Unfittable` names
    what refuses it: the backend's rules, a length the CP degree does not divide (`inputs`: the model's call;
    `splits`, when given: a callable giving every split its `_cp_plan` makes, inner entries included, asked only
    where the rule applies), the attention backend, or its control's."""
    from paracheck.domain.registry import get_control

    options = dict(case.cp_options)
    uneven_ok = options.get("ulysses_anything") or options.get("ring_anything")
    problems = backend_problems(backend, case.layout)
    if case.layout.has_cp and not uneven_ok:
        problems += split_problems(splits(), case.layout) if splits else cp_split_problems(model_class, inputs,
                                                                                             case.layout)
    if problems:
        raise Unfittable("; ".join(problems))
    route = resolve_route(case.route, case.layout, backend.device_type)
    chosen, refused = attention.choose(case.attention_backend, backend.device_type, case.layout)
    if refused:
        raise Unfittable(refused)
    reason = get_control(case.control).skip_reason(case.layout, route) if case.control else None
    if reason:
        raise Unfittable(reason)
    return route, chosen


def _key(case: Case, model_class: type, init_dict: dict, attention: str) -> str:
    source = case.payload or case.factory
    shape = case.shape.to_json() if case.shape else None
    text = json.dumps([source, f"{model_class.__module__}.{model_class.__qualname__}", init_dict, case.variant,
                       shape, case.dtype, case.grads, attention], sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:16]
