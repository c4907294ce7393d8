"""Known failures: upstream bugs declared in TOML, so a run stays green while the table still shows them.

    [[known]]
    model = "flux"              # fixture, spec or test-class name, or the diffusers class; glob patterns
    layout = "r4"               # glob over layout names
    check = "parity.grads"      # a check id, a list of them, or "error" for a case that raises outside the checks
    reason = "ring backward rotates gradient accumulators the wrong way for ring degree > 2"
    upstream = "diffusers 0.42.1 attention_dispatch.TemplatedRingAttention.backward"

Optional keys: `library` (whose models the entry is about, an adapter's name: any unless it says), `variant`, `dtype`, `route`, `cp_options` (globs, default "*"; `cp_options` is matched
against the case's options written `name=value,...` in name order, e.g. "*ulysses_anything=True*"),
`inputs`, what the case's inputs must carry (a list of "mask": an attention mask is given, "padded": it
masks something out), so a bug in mask handling matches a user's own inputs whatever they are called,
and `message`, a glob the failure's text (the error, or the failing check's detail) must match, for a bug
that shares its check with others; `site`, a glob the named check's typed failure site must match (its
`Failure.site`: where it raised, or the origin a check typed, e.g. "tp_plan:replicated_with_grad_allreduce"),
the typed way to the same end (with a list of checks, each failing check's own text and site are matched);
`fixed_in` ("DISTRIBUTION 1.2.0"), the release that fixed the bug: where it or a
later one is installed the entry is left out, so the case passes plainly and a return of the bug fails. A plain case that fails the named check becomes `xfail`; one that
matches an entry and passes becomes `xpass`, so the entry can go.
Torch-free.
"""

from __future__ import annotations

import fnmatch
import os
import tomllib
from dataclasses import asdict, dataclass, fields

from paracheck.domain.case import options_text
from paracheck.domain.records import CaseStatus, CheckId, FailureKind, Status

SHIPPED = os.path.join(os.path.dirname(__file__), "known_failures.toml")
_MATCHED = ("library", "model", "layout", "variant", "dtype", "route", "cp_options")
#: What `inputs` may require (found on the ranks by `checks.traits.input_traits`, for every library).
INPUT_TRAITS = ("mask", "padded")
#: Before a rank runs a case, the variants whose inputs may carry each trait (the libraries' masked and padded
#: inputs; a base input may carry a mask of ones, which masks nothing out).
VARIANT_TRAITS = {"mask": ("base", "masked", "uneven", "left_pad", "right_pad", "packed"),
                  "padded": ("masked", "left_pad", "right_pad", "packed")}


class KnownFailuresError(ValueError):
    """A known-failures file that cannot be read or names something that does not exist."""


@dataclass(frozen=True)
class KnownFailure:
    reason: str
    model: str = "*"
    layout: str = "*"
    #: "*", "error", a check id, or a tuple of check ids: what the entry declares failing.
    check: str | tuple[str, ...] = "*"
    variant: str = "*"
    dtype: str = "*"
    route: str = "*"
    cp_options: str = "*"
    message: str = "*"
    site: str = "*"
    inputs: tuple[str, ...] = ()
    upstream: str = ""
    library: str = "*"
    #: "<distribution> <version>": the release that fixed it; the entry holds only where an older one is installed.
    fixed_in: str = ""

    def __post_init__(self):
        # A list (TOML's, JSON's) kept as a tuple: entries are hashed and compared, and a list is neither.
        if isinstance(self.check, list):
            object.__setattr__(self, "check", tuple(self.check))
        if isinstance(self.inputs, list):
            object.__setattr__(self, "inputs", tuple(self.inputs))

    def holds_here(self) -> bool:
        """Whether the installed release still has the bug: no `fixed_in`, an older release, or none installed."""
        if not self.fixed_in:
            return True
        from importlib.metadata import PackageNotFoundError, version

        name, fixed = _release(self.fixed_in)
        try:
            return _version(version(name)) < fixed
        except PackageNotFoundError:
            return True

    @property
    def check_ids(self) -> tuple[CheckId, ...]:
        """The checks the entry declares failing, one by one; none for "*" and "error"."""
        if self.check in ("*", "error"):
            return ()
        return (CheckId(self.check),) if isinstance(self.check, str) else tuple(CheckId(c) for c in self.check)

    def matches(self, verdict) -> bool:
        """Whether the entry names this verdict's case (model or class, layout, variant, dtype, route, options)."""
        c = verdict.case
        values = {"model": (c.model, verdict.model_class or ""), "layout": (c.layout.name,),
                  "variant": (c.variant,), "dtype": (c.dtype,), "route": (verdict.route.value,),
                  "cp_options": (options_text(c.cp_options),), "library": (c.library,)}
        return set(self.inputs) <= set(verdict.inputs) and \
            all(any(fnmatch.fnmatchcase(v, getattr(self, key)) for v in values[key]) for key in _MATCHED)

    def may_meet(self, case, model_class: str = "") -> bool:
        """Whether `case` can meet this entry, judged before any rank runs it: what only a rank knows (the
        resolved route, what the inputs carry, the failure's text) is guessed from the case's route and
        variant, so the answer errs towards yes."""
        values = {"model": (case.model, model_class), "layout": (case.layout.name,), "variant": (case.variant,),
                  "dtype": (case.dtype,), "route": (case.route.value,), "cp_options": (options_text(case.cp_options),),
                  "library": (case.library,)}
        if self.route != "*" and case.route.value == "auto":
            values["route"] = ("auto", "native", "composed")  # what auto resolves to; sharded-load is asked for
        carried = {trait for trait, variants in VARIANT_TRAITS.items() if case.variant in variants}
        return set(self.inputs) <= carried and \
            all(any(fnmatch.fnmatchcase(v, getattr(self, key)) for v in values[key]) for key in _MATCHED)

    def message_matches(self, verdict, check: CheckId | None = None) -> bool:
        """Whether `message` matches the case's reason or `check`'s detail, and `site` `check`'s failure site (the
        case's, where no check is named); "*" matches anything."""
        failing = verdict.check(check) if check is not None else None
        if not self.site_matches(failing.failure if failing is not None else verdict.failure):
            return False
        if self.message == "*":
            return True
        texts = [verdict.reason] + ([failing.detail] if failing is not None else [])
        return any(fnmatch.fnmatchcase(t, self.message) for t in texts if t)

    def site_matches(self, failure) -> bool:
        """Whether `failure` (a `Failure`, or None where nothing typed one) was met at this entry's `site`."""
        return self.site == "*" or (failure is not None and fnmatch.fnmatchcase(failure.site, self.site))

    def declares(self, verdict) -> bool:
        """Whether `message` and `site` match the way the entry says `verdict` failed: one of its named checks'
        detail and site, or the case's reason and failure for "*" and "error"."""
        if not self.check_ids:
            return self.message_matches(verdict)
        return any(self.message_matches(verdict, c) for c in self.check_ids)

    def passes_in(self, verdict) -> bool:
        """The failure this entry declares did not happen: the case passed, and of its checks, at least one ran on
        every rank and every one that ran passed (a check the run skipped did not run). An entry that names a
        `message` or a `site` declares one failure of several its checks may show, so a pass says nothing about it."""
        if self.message != "*" or self.site != "*":
            return False
        if self.check in ("*", "error"):
            return verdict.status == CaseStatus.PASS
        ran = [m for m in (verdict.check(c) for c in self.check_ids) if m is not None and m.status != Status.SKIP]
        return verdict.status == CaseStatus.PASS and bool(ran) and all(m.status == Status.PASS for m in ran)

    @property
    def text(self) -> str:
        return self.reason + (f" [{self.upstream}]" if self.upstream else "")


def load(path: str | None) -> list[KnownFailure]:
    """The entries of `path`; None or "none" means no entries; the default is the shipped file."""
    if path is None or path == "none":
        return []
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except OSError as exc:
        raise KnownFailuresError(f"--known-failures {path}: cannot read it ({exc.strerror})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise KnownFailuresError(f"--known-failures {path}: not valid TOML ({exc})") from exc
    entries = [_entry(path, i, raw) for i, raw in enumerate(data.get("known", []))]
    return [e for e in entries if e.holds_here()]


def as_data(entries: list[KnownFailure]) -> list[dict]:
    """The entries as run.json carries them to the ranks (`rank.declared`); `KnownFailure(**data)` reads one back."""
    return [asdict(e) for e in entries]


def _entry(path: str, i: int, raw: dict) -> KnownFailure:
    allowed = {f.name for f in fields(KnownFailure)}
    where = f"--known-failures {path}: entry {i + 1}"
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise KnownFailuresError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")
    if not raw.get("reason"):
        raise KnownFailuresError(f"{where}: needs a 'reason' naming the upstream bug")
    check = _checks(where, raw.get("check", "*"))
    inputs = raw.get("inputs", [])
    if not isinstance(inputs, list) or not set(inputs) <= set(INPUT_TRAITS):
        raise KnownFailuresError(f"{where}: inputs {inputs!r} must be a list of {', '.join(INPUT_TRAITS)}")
    fixed = raw.get("fixed_in", "")
    if fixed and (not isinstance(fixed, str) or _release(fixed) is None):
        raise KnownFailuresError(f"{where}: fixed_in {fixed!r} must be a distribution and a version, "
                                 "e.g. 'DISTRIBUTION 1.2.0'")
    return KnownFailure(**dict(raw, check=check))


def _checks(where: str, check) -> str | tuple[str, ...]:
    """`check` as the entry keeps it: "*", "error", one check id, or a tuple of distinct check ids."""
    ids = {c.value for c in CheckId}
    if isinstance(check, str) and (check in ("*", "error") or check in ids):
        return check
    named = [check] if isinstance(check, str) else check
    if not isinstance(named, list) or not named or not all(isinstance(c, str) and c in ids for c in named):
        raise KnownFailuresError(f"{where}: check {check!r} must be a check id, a non-empty list of check ids, "
                                 f"'error' or '*'; check ids: {', '.join(sorted(ids))}")
    twice = sorted({c for c in named if named.count(c) > 1})
    if twice:
        raise KnownFailuresError(f"{where}: check {check!r} names {', '.join(twice)} twice; each check once")
    return tuple(named)


def _release(text: str):
    """("name", Version) of "name 1.2.0", or None where it is not that."""
    parts = text.split()
    version = _version(parts[1]) if len(parts) == 2 else None
    return (parts[0], version) if version is not None else None


def _version(text: str):
    from packaging.version import InvalidVersion, Version

    try:
        return Version(text)
    except InvalidVersion:
        return None


def apply(verdicts: list, entries: list[KnownFailure]) -> None:
    """Mark plain cases as `xfail` when declared entries explain every way they failed, and declared
    failures that passed as `xpass`."""
    for v in verdicts:
        if v.case.control or v.status == CaseStatus.SKIP:
            continue
        matching = [e for e in entries if e.matches(v)]
        if v.status in (CaseStatus.FAIL, CaseStatus.ERROR):
            explaining = _explaining(v, matching)
            if explaining:
                v.status, v.known = CaseStatus.XFAIL, "; ".join(e.text for e in explaining)
                v.reason = f"known upstream failure: {'; '.join(e.reason for e in explaining)} ({v.reason})"
            continue
        passed = next((e for e in matching if e.passes_in(v)), None)
        if passed is not None:
            v.status, v.known = CaseStatus.XPASS, passed.text
            v.reason = f"declared as a known failure but passed; remove the entry: {passed.reason}"


def explaining(verdict, entries: list[KnownFailure]) -> list[KnownFailure]:
    """The declared entries that together explain how `verdict` failed or raised (any case, a control's too);
    empty when one way is unexplained."""
    return _explaining(verdict, [e for e in entries if e.matches(verdict)])


def _explaining(verdict, matching: list[KnownFailure]) -> list[KnownFailure]:
    """The entries that together explain every failing check (or the raise); empty when one is unexplained
    (`explaining_entries`, with each entry's message and site held to the verdict's words, and only entries that
    may declare the case's kind of failure, `_may_declare`)."""
    kind = verdict.failure.kind if verdict.failure is not None else None
    usable = [e for e in matching if _may_declare(e, kind) and (e.check_ids or (e.message_matches(verdict) and (
        e.check == "*" or verdict.status == CaseStatus.ERROR)))]  # "error" covers a raise only
    return explaining_entries(verdict.failing_checks, usable, lambda e, c: e.message_matches(verdict, c))


def _may_declare(entry: KnownFailure, kind: FailureKind | None) -> bool:
    """Whether `entry` may declare a case that failed as `kind`: a hang only by a whole-case entry naming it (its
    message or site), as a declared hang does not break the run (`report.exit_code`) and a catch-all entry for a
    family's raises must not hide a new deadlock; a rank that died or exited without a result only by a whole-case
    entry, never one declaring checks' wrong numbers, whatever else failed; any other failure by any entry."""
    if kind == FailureKind.HANG:
        return not entry.check_ids and (entry.message != "*" or entry.site != "*")
    if kind == FailureKind.EXIT:
        return not entry.check_ids
    return True


def explaining_entries(failing, matched: list[KnownFailure], declares=lambda entry, check: True) -> list[KnownFailure]:
    """The rule the host's verdict (`apply`) and the rank's rerun decision (`rank.declared.explained`) share: of
    `matched` (the entries meeting a case, in file order), those that together explain its failing checks `failing`.
    An entry over every check ("*", or "error" where the caller kept one) explains it alone, the file's first; else
    every failing check needs an entry declaring it (`declares(entry, check)`; of several, the file's last), named in
    check order; none where one is unexplained, or nothing failed."""
    whole = [e for e in matched if not e.check_ids]
    if whole:
        return whole[:1]
    by_check = {c: e for e in matched for c in e.check_ids if declares(e, c)}
    if not failing or not set(failing) <= set(by_check):
        return []
    return list(dict.fromkeys(by_check[c] for c in CheckId if c in failing))
