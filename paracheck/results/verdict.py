"""Verdicts: every rank's result for a case merged into one `Verdict`, judged in one pipeline (`judge`)
used by `run`, its progress lines, torchrun, the pytest mixins and explore.

Pure and torch-free. `judge` is the pipeline: `merge` names the failing ranks per check and decides a
case's status on its own (a control by `Control.judge`, against what it must trip), `known.apply` turns
declared upstream failures into xfail / xpass, and `judge_controls` marks a control inconclusive when its
plain case already fails what the control must trip.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from paracheck.results import known, localization
from paracheck.launch.attribution import ranks_named
from paracheck.domain.case import Case
from paracheck.domain.localization import Localization, integer, ints, number, text
from paracheck.domain.registry import get_control
from paracheck.domain.records import (TO_CASE, CaseStatus, CheckId, CheckResult, Failure, FailureKind, Finding,
                                      MergedCheck, RankResult, RankStatus, Route, Status, enum_value)

#: The adapter of a case read back from a report (`Verdict.from_json`): a report does not name it.
FROM_REPORT = "(read from a report)"
#: What a report writes of each case besides the verdict's own fields (`report.to_json`): never lifted.
REPORT_FIELDS = ("replay", "resumed")


@dataclass(frozen=True)
class LayoutName:
    """Not a layout: a report's name for one, and its mesh order, which a verdict read back from JSON holds as its
    case's layout (`Verdict.from_json`). Kept apart from the host `Layout` (`domain.layout`) on purpose: a `Layout`
    is its adapter's grammar applied to a name (degrees, mesh, groups), a report names no adapter, and every reader
    of a report (the renderers, `--resume`, `compare_reports`) asks the name and order alone; folding the two would
    mean guessing a grammar."""
    name: str
    order: str = "cp-fastest"


@dataclass
class Verdict:
    case: Case
    status: CaseStatus
    route: Route
    reason: str = ""
    checks: list[MergedCheck] = field(default_factory=list)
    fit: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    cause_ranks: list[int] = field(default_factory=list)
    secondary_ranks: list[int] = field(default_factory=list)
    traceback: str = ""
    stacks: dict[int, str] = field(default_factory=dict)
    #: The known-failure entry that matched (its upstream reason), if any.
    known: str | None = None
    #: Why the case failed, raised or skipped, typed (see `records.Failure`); None when it passed.
    failure: Failure | None = None
    attention_backend: str | None = None
    seconds: float = 0.0
    model_class: str | None = None
    #: What the inputs carry ("mask", "padded"; `checks.traits.input_traits`).
    inputs: list[str] = field(default_factory=list)
    #: Seconds per phase, the slowest rank's.
    timings: dict = field(default_factory=dict)
    #: Every rank's peak resident memory (MiB) when the case ended.
    peak_rss_mb: list[float] = field(default_factory=list)
    #: Every rank's resident memory (MiB) and CPU seconds since it started, when the case ended.
    rss_mb: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)
    #: Every rank's threads and process groups when the case ended.
    threads: list[int] = field(default_factory=list)
    process_groups: list[int] = field(default_factory=list)
    #: Where a failing parity check's difference arises, merged over ranks (`results.localization`).
    localization: Localization = field(default_factory=Localization)
    #: What a check lifts to the case's JSON (`records.TO_CASE`: a pipeline's per-step curve and pictures), the
    #: worst rank's, with `rank` naming it.
    lifted: dict = field(default_factory=dict)

    @property
    def id(self) -> str:
        return self.case.id_with(self.route)

    def check(self, check_id: CheckId) -> MergedCheck | None:
        return next((c for c in self.checks if c.id == check_id), None)

    @property
    def failing_checks(self) -> set:
        return {c.id for c in self.checks if c.status == Status.FAIL}

    @property
    def never(self) -> bool:
        """The skip says the model can never take this kind of layout (it has no plan for it)."""
        return bool(self.failure and self.failure.missing_plan)

    @property
    def failed_ranks(self) -> list[int]:
        return sorted({r for c in self.checks for r in c.failed_ranks} | set(self.cause_ranks))

    def to_json(self) -> dict:
        c = self.case
        data = {"id": self.id, "model": c.model, "layout": c.layout.name, "order": c.layout.order,
                "route": self.route.value, "variant": c.variant, "dtype": c.dtype,
                "cp_options": dict(c.cp_options), "inputs": self.inputs, "control": c.control,
                "attention_backend": self.attention_backend, "status": self.status.value, "reason": self.reason,
                "checks": [m.to_json() for m in self.checks], "fit": self.fit,
                "findings": [f"input not split on {ranks_named(f.ranks)}: {f.message}" for f in self.findings],
                **({"findings_seen": [f.to_json() for f in self.findings]} if self.findings else {}),
                "seconds": self.seconds, "timings": self.timings, "peak_rss_mb": self.peak_rss_mb,
                "rss_mb": self.rss_mb, "cpu_seconds": self.cpu_seconds, "threads": self.threads,
                "process_groups": self.process_groups}
        if self.localization:
            data["localization"] = self.localization.to_json()
        data.update({k: v for k, v in self.lifted.items() if k not in data})
        if self.failure:
            data["failure"] = self.failure.to_json()
        if self.known:
            data["known_failure"] = self.known
        if self.status == CaseStatus.ERROR:
            data.update(error_ranks=self.cause_ranks, secondary_ranks=self.secondary_ranks, traceback=self.traceback,
                        stacks={str(k): v for k, v in self.stacks.items()})
        return data

    @classmethod
    def from_json(cls, data: dict) -> "Verdict":
        """A report's case read back, by the fields `to_json` writes: `from_json(v.to_json()).to_json() ==
        v.to_json()`. Never raises on a field that is not the schema's: it reads as absent (a check this version
        does not know is left out; a status it does not know reads as an error, something to look at). What a
        report does not carry is absent too: the case's factory and adapter (`FROM_REPORT`), the route it asked for
        (the case holds the one that ran), its tolerances, the model class. Every top-level field that is not the
        verdict's is what its checks lifted (`lifted`), the report's own (`REPORT_FIELDS`) excepted."""
        options, stacks = data.get("cp_options"), data.get("stacks")
        route = enum_value(Route, data.get("route")) or Route.AUTO
        case = Case(_text(data.get("model"), ""), "", LayoutName(_text(data.get("layout"), ""),
                                                                 _text(data.get("order"), "cp-fastest")),
                    route, text(data.get("control")), variant=_text(data.get("variant"), "base"),
                    dtype=_text(data.get("dtype"), "fp32"), library=FROM_REPORT,
                    cp_options=tuple(options.items()) if isinstance(options, dict) else ())
        checks = [MergedCheck.from_json(c) for c in _list(data.get("checks"))]
        findings = ([Finding.from_json(f) for f in _list(data.get("findings_seen"))] if "findings_seen" in data
                    else [_finding_line(f) for f in _list(data.get("findings"))])
        timings = data.get("timings") if isinstance(data.get("timings"), dict) else {}
        stacks = stacks if isinstance(stacks, dict) else {}
        return cls(
            case=case, status=enum_value(CaseStatus, data.get("status")) or CaseStatus.ERROR, route=route,
            reason=_text(data.get("reason"), ""), checks=[c for c in checks if c is not None],
            fit=_texts(data.get("fit")), findings=[f for f in findings if f is not None],
            cause_ranks=ints(data.get("error_ranks")), secondary_ranks=ints(data.get("secondary_ranks")),
            traceback=_text(data.get("traceback"), ""),
            stacks={int(k): v for k, v in stacks.items() if str(k).isdigit() and isinstance(v, str)},
            known=text(data.get("known_failure")) or None, failure=Failure.from_json(data.get("failure")),
            attention_backend=text(data.get("attention_backend")), seconds=number(data.get("seconds")) or 0.0,
            model_class=None, inputs=_texts(data.get("inputs")),
            timings={str(k): v for k, v in timings.items() if number(v) is not None},
            **{k: _numbers(data.get(k)) for k in ("peak_rss_mb", "rss_mb", "cpu_seconds")},
            **{k: [v for v in _list(data.get(k)) if integer(v) is not None] for k in ("threads", "process_groups")},
            localization=Localization.from_json(data.get("localization")),
            lifted={k: v for k, v in data.items() if k not in _WRITTEN and k not in REPORT_FIELDS})


#: The top-level fields `Verdict.to_json` writes of the verdict itself (any other is lifted).
_WRITTEN = frozenset(("id model layout order route variant dtype cp_options inputs control attention_backend status "
                      "reason checks fit findings findings_seen seconds timings peak_rss_mb rss_mb cpu_seconds threads "
                      "process_groups localization failure known_failure error_ranks secondary_ranks traceback "
                      "stacks").split())


#: A finding as `findings` words it: what a report written before `findings_seen` (or by hand) holds alone.
_FINDING_LINE = re.compile(r"input not split on ranks? ((?:\d+(?:-\d+)?)(?:,\d+(?:-\d+)?)*|): (.*)", re.DOTALL)


def _finding_line(line) -> Finding | None:
    found = _FINDING_LINE.fullmatch(line) if isinstance(line, str) else None
    if not found:
        return None
    spans = [[int(n) for n in part.split("-")] for part in found[1].split(",") if part]
    return Finding(found[2], [r for span in spans for r in range(span[0], span[-1] + 1)])


def _text(value, default: str) -> str:
    found = text(value)
    return default if found is None else found


def _list(value) -> list:
    return value if isinstance(value, list) else []


def _texts(value) -> list[str]:
    return [v for v in _list(value) if isinstance(v, str)]


def _numbers(value) -> list:
    """The figures in a list, as written (an int stays an int)."""
    return [v for v in _list(value) if number(v) is not None]


def merge_checks(ranks: list[RankResult]) -> list[MergedCheck]:
    secondary = frozenset(r.rank for r in ranks if r.secondary)
    merged = []
    for check_id in CheckId:
        per_rank = [(r.rank, c) for r in ranks for c in r.checks if c.id == check_id]
        if per_rank:
            merged.append(merge_check(check_id, per_rank, secondary))
    return merged


def merge_check(check_id: CheckId, per_rank: list[tuple[int, CheckResult]], secondary=frozenset()) -> MergedCheck:
    """One check over the ranks that ran it (rank, result): failed anywhere fails; the detail shown is
    the first failing rank's that did not only wait on another (`secondary`). The simulation merges here too."""
    failed = [rank for rank, c in per_rank if c.status == Status.FAIL]
    statuses = {c.status for _, c in per_rank}
    status = Status.FAIL if failed else (Status.PASS if Status.PASS in statuses else Status.SKIP)
    shown = next(((r, c) for r, c in per_rank if c.status == Status.FAIL and r not in secondary),
                 None) or next(((r, c) for r, c in per_rank if c.status == Status.FAIL),
                 next(((r, c) for r, c in per_rank if c.detail), per_rank[0]))
    return MergedCheck(
        check_id, status, failed, _worst(c.max_abs for _, c in per_rank),
        _worst(c.max_rel for _, c in per_rank), per_rank[0][1].atol, per_rank[0][1].rtol,
        shown[1].detail, shown[0] if shown[1].detail else None, _merge_data(per_rank), shown[1].failure,
        _merge_facets(per_rank))


def _merge_facets(per_rank) -> dict:
    """Each part passes where it passed on every rank that ran it."""
    merged: dict[str, bool] = {}
    for _, c in per_rank:
        for name, passed in (c.facets or {}).items():
            merged[name] = merged.get(name, True) and bool(passed)
    return merged


def _worst(values) -> float | None:
    return max((v for v in values if v is not None), default=None)


def _merge_data(per_rank) -> dict:
    data = {str(rank): _own(c.data) for rank, c in per_rank if _own(c.data or {})}
    return {"per_rank": data} if data else {}


def _own(data: dict) -> dict:
    """A rank's check data without what the case carries once (its localization, what it lifts)."""
    return {k: v for k, v in localization.strip(data).items() if k != TO_CASE}


def lifted(ranks: list[RankResult]) -> dict:
    """What the checks lift to the case (`records.TO_CASE`): per check, the payload of the rank whose check failed
    with the largest max_abs (or of the largest max_abs when none failed), and `rank`, that rank."""
    out = {}
    for check_id in CheckId:
        held = [(r.rank, c) for r in ranks for c in r.checks if c.id == check_id and TO_CASE in (c.data or {})]
        if held:
            rank, shown = max(held, key=lambda rc: (rc[1].status == Status.FAIL, rc[1].max_abs or 0.0, -rc[0]))
            out.update(shown.data[TO_CASE], rank=rank)
    return out


def _per_check(ranks: list[RankResult]) -> dict:
    return {check_id: [(r.rank, c) for r in ranks for c in r.checks if c.id == check_id] for check_id in CheckId}


def _findings(ranks: list[RankResult]) -> list[Finding]:
    by_message: dict[str, list[int]] = {}
    for r in ranks:
        for message in r.findings:
            by_message.setdefault(message, []).append(r.rank)
    return [Finding(m, sorted(rs)) for m, rs in by_message.items()]


def merge(case: Case, ranks: list[RankResult]) -> Verdict:
    """One verdict from every rank's result (controls judged alone; see `judge_controls`)."""
    ranks = sorted(ranks, key=lambda r: r.rank)
    first = ranks[0]
    v = Verdict(case, CaseStatus.PASS, first.route or next((r.route for r in ranks if r.route), case.route),
                fit=first.fit, findings=_findings(ranks), checks=merge_checks(ranks),
                attention_backend=first.attention_backend, seconds=max(r.seconds for r in ranks),
                model_class=first.model_class, inputs=first.inputs,
                timings={k: max(r.timings.get(k, 0.0) for r in ranks) for r in ranks for k in r.timings},
                peak_rss_mb=[r.peak_rss_mb for r in ranks], rss_mb=[r.rss_mb for r in ranks],
                cpu_seconds=[r.cpu_seconds for r in ranks], threads=[r.threads for r in ranks],
                process_groups=[r.process_groups for r in ranks],
                localization=localization.merge(_per_check(ranks)), lifted=lifted(ranks))
    statuses = {r.status for r in ranks}
    if RankStatus.ERROR in statuses and not (case.control and _judgeable(v, ranks)):
        return _error(v, ranks)
    if statuses == {RankStatus.SKIP}:
        v.status, v.reason, v.failure = CaseStatus.SKIP, first.reason, first.failure
        return v
    if RankStatus.SKIP in statuses:
        v.status, v.reason = CaseStatus.ERROR, f"ranks disagree: {sorted(s.value for s in statuses)}"
        v.failure = Failure(FailureKind.DISAGREE)
        return v
    failing = v.failing_checks
    if case.control:
        v.status, v.reason = _judged(get_control(case.control), v, ranks, failing)
        found = localization.planted(get_control(case.control), v.localization,
                                     next((r.planted_in for r in ranks if r.planted_in), None))
        if found:
            v.localization = v.localization.with_planted(found)
    elif failing:
        v.status, v.reason = CaseStatus.FAIL, f"failed: {', '.join(c.value for c in CheckId if c in failing)}"
        v.failure = _first_failing(v)
    return v


def _first_failing(v: Verdict, waited: set = frozenset()) -> Failure | None:
    """The first failing check's identity (the first symptom names the bug). A check that failed only on ranks in
    `waited` (their collective broke when the rank they waited on went away) is no symptom: the cause's is."""
    first = next((m for m in v.checks if m.status == Status.FAIL and set(m.failed_ranks) - waited), None)
    return first and (first.failure or Failure(FailureKind.CHECK, first.id))


def _judgeable(v: Verdict, ranks: list[RankResult]) -> bool:
    """A control whose bug broke the world can still be judged where its must-trip checks failed: every rank that
    errored waited on or lost a peer, or raised in the code under test (not the kit's: `Failure.raised_by`) in a
    pass whose check the control must trip, as a real bug of its shape would raise there (Qwen3-Omni's deepstack
    indexing the features by the misplaced placeholders)."""
    raised = set(_raised_by_the_bug(get_control(v.case.control), ranks))
    return bool(v.checks) and all(r.secondary or r.rank in raised for r in ranks if r.status == RankStatus.ERROR)


def _judged(control, v: Verdict, ranks: list[RankResult], failing: set) -> tuple[CaseStatus, str]:
    """The control's verdict on the checks that failed; where its bug made the library raise in a pass it must trip
    (`_raised_by_the_bug`), the checks that pass kept from running are not counted as passing."""
    must = set(control.must_trip)
    raised = _raised_by_the_bug(control, ranks)
    ran = {m.id for m in v.checks if m.status != Status.SKIP}
    unrun = [c for c in control.must_trip if c not in ran]
    if not raised or not unrun or not must & failing or not (must & ran) <= failing:
        return control.judge(failing)
    tripped = ", ".join(c.value for c in control.must_trip if c in failing)
    return CaseStatus.DETECTED, (f"planted {control.name}; tripped {tripped} (the library raised there on "
                                 f"{ranks_named(raised)}); {', '.join(c.value for c in unrun)} never ran after it")


def _raised_by_the_bug(control, ranks: list[RankResult]) -> list[int]:
    """The ranks that errored by a raise in the code under test (not the kit's) in a pass `control` must trip."""
    must = set(control.must_trip)
    return [r.rank for r in ranks if r.status == RankStatus.ERROR and r.failure is not None
            and r.failure.kind == FailureKind.RAISE and r.failure.raised_by == "library" and r.failure.check in must]


def _error(v: Verdict, ranks: list[RankResult]) -> Verdict:
    errors = [r for r in ranks if r.status == RankStatus.ERROR]
    causes = [r for r in errors if not r.secondary] or errors
    root = causes[0]
    v.status = CaseStatus.ERROR
    v.cause_ranks = [r.rank for r in causes]
    v.secondary_ranks = [r.rank for r in errors if r.secondary]
    v.reason = f"rank {root.rank}: {root.reason}"
    if len(causes) > 1:
        v.reason += f" (also {ranks_named(r.rank for r in causes[1:])})"
    if v.secondary_ranks:
        waited = "were" if len(v.secondary_ranks) > 1 else "was"
        v.reason += f"; {ranks_named(v.secondary_ranks)} {waited} waiting on {'it' if len(causes) == 1 else 'them'}"
    v.failure = _first_failing(v, waited=set(v.secondary_ranks)) or root.failure or Failure(FailureKind.EXIT)
    v.traceback = root.traceback
    v.stacks = {r.rank: r.stack for r in errors if r.stack}
    return v


def judge(cases: list[Case], results: list[list[RankResult]], entries, plain_so_far: dict | None = None) -> list[Verdict]:
    """The one judging pipeline: one verdict per case from its ranks' results (`merge`), declared upstream
    failures applied (`known.apply` with `entries`), then every control judged against its plain case.

    A caller that judges cases one at a time passes the same `plain_so_far` dict each time: it holds the
    plain verdicts judged so far (this call adds its own), so a later control still finds its plain case."""
    verdicts = [merge(c, r) for c, r in zip(cases, results)]
    known.apply(verdicts, entries)
    plain = {} if plain_so_far is None else plain_so_far
    plain.update({v.case.plain: v for v in verdicts if not v.case.control})
    judge_declared_raises(verdicts, plain, entries)
    judge_controls(verdicts, plain)
    return verdicts


def judge_declared_raises(verdicts: list[Verdict], plain: dict, entries) -> None:
    """A control whose ranks raised the upstream failure its plain case is declared for (the same entries explain
    the raise) is no kit error: it is judged on the checks it must trip, detected where each failed, missed where
    one passed, inconclusive where one never ran before the raise (then `judge_controls` holds it to what its plain
    case passes). An upstream failure that raises in every pass raises in a planted case too, after the checks
    before it have run (docs/transformers.md names one)."""
    for v in verdicts:
        base = plain.get(v.case.plain)
        if not v.case.control or v.status != CaseStatus.ERROR or base is None or base.status != CaseStatus.XFAIL:
            continue
        explaining = known.explaining(v, entries)
        # the plain case's own entries: a broad one ("error", any message) must not excuse a plant that raised
        declared = {e for e in entries if e.matches(base) and e.declares(base)}
        if not explaining or not set(explaining) <= declared:
            continue
        v.known = "; ".join(e.text for e in explaining)
        control = get_control(v.case.control)
        raised = f"its ranks then raised its plain case's declared upstream failure ({v.reason})"
        unrun = [c.value for c in control.must_trip if (v.check(c) is None or v.check(c).status == Status.SKIP)]
        if unrun:
            v.status, v.reason = CaseStatus.INCONCLUSIVE, f"{', '.join(unrun)} never ran: {raised}"
            continue
        status, reason = control.judge(v.failing_checks)
        v.status, v.reason = status, f"{reason}; {raised}"


def judge_controls(verdicts: list[Verdict], plain: dict | None = None) -> None:
    """A control cannot be judged where its plain case already fails what it must trip (or raised):
    mark it inconclusive, never missed. `plain`: plain case -> its verdict (default: those in `verdicts`)."""
    plain = {v.case.plain: v for v in verdicts if not v.case.control} if plain is None else plain
    for v in verdicts:
        if not v.case.control or v.status == CaseStatus.SKIP:
            continue
        if v.failure is not None and v.failure.kind == FailureKind.EXIT:
            continue  # a rank died or exited without its result: that is the case's verdict, whatever its plain case
        base = plain.get(v.case.plain)
        control = get_control(v.case.control)
        if base is None or not inconclusive_rule(base, control.must_trip):
            continue
        judged = on_facets(v, base, control)
        if judged is not None:
            v.status, v.reason = judged
            continue
        v.status = CaseStatus.INCONCLUSIVE
        v.reason = (f"its plain case is {base.status.value} and does not pass "
                    f"{', '.join(c.value for c in _not_passing(base, control.must_trip))}, "
                    "so the control cannot be judged")


def on_facets(v: Verdict, plain: Verdict, control) -> tuple[CaseStatus, str] | None:
    """A control judged on the parts its plain case passes, where a check it must trip failed in the plain case on
    some parts only (`CheckResult.facets`: a generation mode an upstream bug breaks, the others right): detected when
    each such check fails in the control case on a part the plain case passed (and each other check it must trip
    fails). None where some check it must trip has no part the plain case passed (inconclusive)."""
    quiet, judged_on = [], []
    for check_id in control.must_trip:
        base, mine = plain.check(check_id), v.check(check_id)
        if base is not None and base.status == Status.PASS:
            tripped = mine is not None and mine.status == Status.FAIL
        else:
            clean = [name for name, passed in (base.facets if base is not None else {}).items() if passed]
            if not clean:
                return None
            judged_on += [f"{check_id.value} {name}" for name in clean]
            tripped = mine is not None and any(mine.facets.get(name) is False for name in clean)
        if not tripped:
            quiet.append(check_id.value)
    on = f" (judged on what its plain case passes: {', '.join(judged_on)})"
    if quiet:
        return CaseStatus.MISSED, f"planted {control.name}; still passing: {', '.join(quiet)}{on}"
    return CaseStatus.DETECTED, f"planted {control.name}; tripped {', '.join(c.value for c in control.must_trip)}{on}"


def _not_passing(plain: Verdict, must_trip) -> list:
    return [c for c in must_trip if (plain.check(c) is None or plain.check(c).status != Status.PASS)]


def inconclusive_rule(plain: Verdict, must_trip) -> bool:
    """Whether a plain case leaves a control unjudgeable: it fails (or is known to) and one of the checks
    the control must trip did not pass there (failed, or never ran because the case raised)."""
    if plain.status not in (CaseStatus.FAIL, CaseStatus.ERROR, CaseStatus.XFAIL):
        return False
    return bool(_not_passing(plain, must_trip))


def outcome_for_test(v: Verdict, check_ids) -> tuple[str, str]:
    """What one pytest test reading `v` does: ("pass" | "fail" | "skip" | "xfail", why).

    A plain test checks `check_ids` only; a control test (no ids) passes when the control was detected."""
    if v.status == CaseStatus.SKIP:
        return "skip", v.reason
    if v.case.control:
        if v.status == CaseStatus.DETECTED:
            return "pass", v.reason
        if v.status == CaseStatus.INCONCLUSIVE:
            return "skip", f"inconclusive: {v.reason}"
        return "fail", f"control {v.case.control} was {v.status.value}: {v.reason}"
    if v.status in (CaseStatus.ERROR, CaseStatus.XFAIL) and not v.checks:
        return ("xfail" if v.status == CaseStatus.XFAIL else "fail"), f"the case raised: {v.reason}"
    merged = {m.id: m for m in v.checks}
    missing = [c.value for c in check_ids if c not in merged]
    if missing:
        return "fail", f"{', '.join(missing)} never ran"
    failing = [c.value for c in check_ids if merged[c].status == Status.FAIL]
    if failing:
        return ("xfail" if v.status == CaseStatus.XFAIL else "fail"), f"{', '.join(failing)} failed: {v.reason}"
    if all(merged[c].status == Status.SKIP for c in check_ids):
        return "skip", "; ".join(merged[c].detail for c in check_ids)
    return "pass", ""
