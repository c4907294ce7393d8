"""Reports from verdicts: the table a person reads, progress lines, JSON and JUnit. Torch-free."""

from __future__ import annotations

import json
import shlex
from dataclasses import replace
from xml.sax.saxutils import escape, quoteattr

from paracheck.launch.attribution import ranks_named, ranks_text
from paracheck import __version__
from paracheck.launch.protocol import Exit, write_text
from paracheck.domain import registry
from paracheck.domain.case import Case
from paracheck.domain.records import (LOCAL_WORLD_LIMITS, LOCAL_WORLD_STOOD_IN, CaseStatus, CheckId, Status,
                                       passed_beyond)
from paracheck.results import localization, resume
from paracheck.results.runmeta import RunMeta
from paracheck.results.grouping import COUNTED, Row, counts, covered, groups
from paracheck.results.verdict import Verdict

CELL = {Status.PASS: "ok", Status.FAIL: "FAIL", Status.SKIP: "-", None: " "}
SHOWN_CHECKS = [c for c in CheckId if not c.simulated]
def summarize(verdicts: list[Verdict]) -> dict:
    """The counts by status (`grouping.counts`), each by its word: {"passed": 3, "failed": 0, ...}."""
    counted = counts(v.status.value for v in verdicts)
    return {word: counted[status] for status, word in COUNTED.items()}


def exit_code(verdicts: list[Verdict], events: list) -> int:
    """BROKEN where an event broke the run (but a hang the case's declared known failure explains), else FAILED
    where a verdict fails, else OK."""
    if any(not declared_hang(e, verdicts) for e in events):
        return Exit.BROKEN
    return Exit.FAILED if any(v.status.failing for v in verdicts) else Exit.OK


def declared_hang(event, verdicts: list[Verdict]) -> bool:
    """Whether `event` is a hang its case's verdict declares (`RunEvent.declared_by`)."""
    v = next((v for v in verdicts if v.id == event.case), None) if event.case else None
    return v is not None and event.declared_by(v.status.value, v.failure.kind.value if v.failure else None)


def replay_command(v: Verdict, argv_extra: list[str]) -> str:
    c = v.case
    args = ["paracheck", "run", "--layouts", c.layout.name, "--route", v.route.value, *argv_extra]
    bundled = registry.fixtures().get(c.model, (None, None))[1] == c.factory
    # An adapter may name the models its own way (a family of transformers' sweep is `--models transformers:NAME`).
    named = registry.adapter(c.library).models_option(c)
    args += named or (["--models", c.model] if bundled else ["--spec", c.factory])
    return " ".join(shlex.quote(a) for a in args + case_options(c))


def case_options(c: Case) -> list[str]:
    """The `paracheck run` options that pick case `c` out of its model's cases, other than `--layouts`."""
    args = ["--variants", c.variant]
    if c.dtype != "fp32":
        args += ["--dtype", c.dtype]
    if c.control:
        args += ["--controls", "--only-control", c.control]
    if c.layout.order != "cp-fastest":
        args += ["--order", c.layout.order]
    return args + registry.adapter(c.library).case_options(c)


def _columns(verdicts: list[Verdict]) -> list[CheckId]:
    """Check columns: the ones some case ran (structure.collectives only where it was measured)."""
    ran = {m.id for v in verdicts for m in v.checks}
    return [c for c in SHOWN_CHECKS if c in ran or c != CheckId.COLLECTIVES]


def _label(v: Verdict) -> str:
    c = v.case
    extra = [x for x in (c.variant if c.variant != "base" else "", c.dtype if c.dtype != "fp32" else "") if x]
    return f"{c.model} {c.layout.name} {v.route.value}" + (f" {'/'.join(extra)}" if extra else "") + \
        (f" [{c.control}]" if c.control else "")


def table(verdicts: list[Verdict]) -> str:
    shown = [v for v in verdicts if v.status != CaseStatus.SKIP]
    checks = _columns(shown)
    optional = [("variant", lambda v: v.case.variant, any(v.case.variant != "base" for v in shown)),
                ("dtype", lambda v: v.case.dtype, any(v.case.dtype != "fp32" for v in shown)),
                ("control", lambda v: v.case.control or "", any(v.case.control for v in shown))]
    optional = [(name, get) for name, get, wanted in optional if wanted]
    head = ["model", "layout", "route", "attention"] + [n for n, _ in optional] + [c.short for c in checks] + \
        ["max_abs", "max_rel", "failed ranks", "status"]
    rows = [head]
    for v in shown:
        cells = {m.id: m.status for m in v.checks}
        fwd = v.check(CheckId.FORWARD)
        rows.append([v.case.model, v.case.layout.name, v.route.value, v.attention_backend or ""]
                    + [get(v) for _, get in optional]
                    + [CELL[cells.get(c)] for c in checks]
                    + [_num(fwd and fwd.max_abs), _num(fwd and fwd.max_rel), ranks_text(v.failed_ranks),
                       v.status.value.upper() if v.status.failing else v.status.value])
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def notes(verdicts: list[Verdict], replays: dict[str, str]) -> str:
    out = []
    for v in verdicts:
        out.extend(_case_notes(v, replays.get(v.id, "")))
    found = groups([Row.of_verdict(i, v) for i, v in enumerate(verdicts)])
    out.extend(f"xfail {g.title}\n      {g.covers}" for g in found if g.kind == "xfail")
    out.extend(_stand_in_groups(verdicts))
    out.extend(_skip_lines(found))
    return "\n".join(out)


def _skip_lines(found) -> list[str]:
    """The skip groups as the terminal writes them (`grouping.groups`)."""
    out = [f"skip  {g.title}\n      {', '.join(r.label for r in g.rows)}" for g in found if g.kind == "skip"]
    out += [f"skip  {g.title}\n      " + "; ".join(f"{c} on {', '.join(ms)}" for c, ms in g.controls)
            for g in found if g.kind == "skip-controls"]
    return out + [f"never {g.never_line}" for g in found if g.kind == "never"]


def _case_notes(v: Verdict, replay: str) -> list[str]:
    out, label = [], _label(v)
    if v.status.failing:
        out.append(f"{v.status.value.upper():5} {label}: {v.reason}")
        if v.status != CaseStatus.MISSED:
            for m in v.checks:
                if m.status == Status.FAIL and m.detail:
                    out.append(f"      {m.id.value} failed on {ranks_named(m.failed_ranks)}: "
                               f"rank {m.detail_rank}: {m.detail}")
        out.extend(f"      {line}" for line in localization.note(v.localization))
        if v.traceback:
            out.append("      " + v.traceback.strip().splitlines()[-1])
        out.append(f"      replay: {replay}")
    elif v.status in (CaseStatus.XPASS, CaseStatus.INCONCLUSIVE):
        out.append(f"{v.status.value:5} {label}: {v.reason}")
    for f in ([] if v.case.control else v.findings):  # a control's inputs are its plain case's
        out.append(f"note  {label}: input not split on {ranks_named(f.ranks)}: {f.message}")
    for m in v.checks:
        if m.status == Status.PASS and passed_beyond(m.data.get("per_rank")):
            out.append(f"note  {label}: {m.id.value} passed only within the reference's own imprecision: {m.detail}")
    return out


def _stand_in_groups(verdicts: list[Verdict]) -> list[str]:
    """One line per library component the kit stood in for where the library's cannot run (a check's
    `data["stood_in"]`: why, what the kit did, what still ran as the library's), then the cases."""
    stood: dict[tuple, list[Row]] = {}
    for i, v in enumerate(verdicts):
        for m in v.checks:
            for held in (m.data.get("per_rank") or {}).values():
                found = held.get("stood_in")
                if found:
                    key = (m.id.value, found["why"], tuple(found["kit"]), tuple(found["library"]))
                    if all(r.index != i for r in stood.setdefault(key, [])):
                        stood[key].append(Row.of_verdict(i, v))
    return [f"stand-in {check}: {why}; the kit stood in for {'; '.join(kit)}; the library's own: {', '.join(lib)}"
            f"\n      {covered(rows)}" for (check, why, kit, lib), rows in stood.items()]


def _num(value) -> str:
    return "" if value is None else f"{value:.1e}"


def progress_line(v: Verdict, done: int, total: int) -> str:
    fwd = v.check(CheckId.FORWARD)
    figure = f" max_abs {fwd.max_abs:.1e}" if fwd and fwd.max_abs is not None else ""
    return f"[{done}/{total}] {v.status.value:12} {_label(v)}{figure} ({v.seconds:.1f}s)"


def local_share(verdicts: list[Verdict], ranks: int) -> dict:
    """What a local world ran (`--local-world`): of its cases, how many ran as every rank in one process, how many it
    could not run that way (a skip typed as a local world's limit, `records.LOCAL_WORLD_LIMITS`), by their failure."""
    limited = [v for v in verdicts if v.status == CaseStatus.SKIP and v.failure is not None
               and v.failure.exception in LOCAL_WORLD_LIMITS]
    other_skips = sum(v.status == CaseStatus.SKIP for v in verdicts) - len(limited)
    by_site: dict[str, int] = {}
    for v in limited:
        key = f"{v.failure.exception} at {v.failure.site}" if v.failure.site else v.failure.exception
        by_site[key] = by_site.get(key, 0) + 1
    ran = len(verdicts) - len(limited) - other_skips
    return {"ranks": ranks, "cases": len(verdicts), "ran": ran, "one_process_limits": len(limited),
            "other_skips": other_skips, "limits": by_site,
            "stood_in": [{"rule": rule, "why": why, "report": path} for rule, why, path in LOCAL_WORLD_STOOD_IN]}


def local_line(share: dict) -> str:
    """One line of what a local world ran, for the end of the run."""
    limits = "; ".join(f"{n} {why}" for why, n in sorted(share["limits"].items()))
    return (f"local world of {share['ranks']} ranks in one process: {share['ran']} of {share['cases']} cases ran; "
            f"{share['one_process_limits']} could not run as every rank in one process"
            + (f" ({limits})" if limits else "") + f"; {share['other_skips']} skipped for other reasons"
            + "".join(f"\nstand-in: torch's {s['rule']}: {s['why']} ({s['report']})" for s in share["stood_in"]))


def counts_line(verdicts: list[Verdict], seconds: float, worlds: int, extra: str = "") -> str:
    s = summarize(verdicts)
    parts = [f"{s[k]} {k}" for k in COUNTED.values() if s[k] or k in ("passed", "failed", "errors", "skipped")]
    return f"{', '.join(parts)} in {seconds:.1f}s ({worlds} world{'s' if worlds != 1 else ''}{extra})"


def to_json(verdicts: list[Verdict], meta: RunMeta, events: list, replays: dict[str, str] | None = None,
            carried: list[dict] = (), not_run: list[str] = ()) -> dict:
    """The JSON report; `replays` (case id -> the command that runs it alone) adds each case's `replay`.
    `carried`: a resumed report's cases, as it wrote them (marked `resumed`), counted and judged with the rest;
    `not_run`: the ids of the cases an interrupted run never finished (`results.resume`)."""
    cases = [dict(c, resumed=True) for c in carried]
    cases += [dict(v.to_json(), **({"replay": replays[v.id]} if replays and v.id in replays else {}))
              for v in verdicts]
    summary = summarize(verdicts)
    for entry in carried:
        summary[COUNTED[CaseStatus(entry["status"]).value]] += 1
    code = exit_code(verdicts, events)
    if code == 0 and any(CaseStatus(c["status"]).failing for c in carried):
        code = Exit.FAILED
    data = dict(meta.to_json(), cases=cases, summary=summary, events=[e.to_json() for e in events], exit_code=int(code))
    if not_run:
        data[resume.NOT_RUN] = list(not_run)
        summary[resume.NOT_RUN] = len(not_run)
    return data


def to_junit(verdicts: list[Verdict]) -> str:
    lines = []
    for v in verdicts:
        lines.append(f"  <testcase classname=\"paracheck\" name={quoteattr(v.id)} time=\"{v.seconds:.3f}\">")
        if v.status in (CaseStatus.SKIP, CaseStatus.XFAIL, CaseStatus.INCONCLUSIVE):
            lines.append(f"    <skipped message={quoteattr(v.status.value + ': ' + v.reason)}/>")
        elif v.status in (CaseStatus.FAIL, CaseStatus.MISSED):
            detail = json.dumps([m.to_json() for m in v.checks], indent=1)
            lines.append(f"    <failure message={quoteattr(v.reason)}>{escape(detail)}</failure>")
        elif v.status == CaseStatus.ERROR:
            lines.append(f"    <error message={quoteattr(v.reason)}>{escape(v.traceback)}</error>")
        lines.append("  </testcase>")
    s = summarize(verdicts)
    skipped = s["skipped"] + s["xfailed"] + s["inconclusive"]
    head = (f"<testsuite name=\"paracheck\" tests=\"{len(verdicts)}\" failures=\"{s['failed'] + s['missed']}\" "
            f"errors=\"{s['errors']}\" skipped=\"{skipped}\">")
    return "\n".join(['<?xml version="1.0" encoding="utf-8"?>', head, *lines, "</testsuite>", ""])


def write_report(path: str, data) -> None:
    """Write a report whole or not at all (JSON for a dict or list, else the text as is): a run stopped
    mid-write leaves the previous report, never half of a new one."""
    import json

    write_text(path, data if isinstance(data, str) else json.dumps(data, indent=1))


def run_meta(backend, nproc: int, outcome=None) -> RunMeta:
    """What a report says about the run: versions, backend, ranks, and how the worlds started."""
    from importlib.metadata import version

    versions = {}
    for package in dict.fromkeys(("torch", *registry.adapters())):  # each adapter is named after its library
        try:
            versions[package] = version(package)
        except Exception:
            versions[package] = None
    meta = RunMeta(paracheck=__version__, backend=backend.name, nproc=nproc, versions=versions)
    if outcome is not None:
        meta = replace(meta, worlds=outcome.worlds, start_method=outcome.start_method, references=outcome.references,
                       start_seconds=round(outcome.start_seconds, 3))
    return meta
