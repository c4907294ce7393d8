"""Reports: per-rank results merged into one verdict per case, as a table, JSON and JUnit XML."""

from __future__ import annotations

import json
import shlex
from xml.sax.saxutils import escape, quoteattr

from .case import Case
from .checks import CHECK_IDS
from .controls import get_control

SHORT_NAMES = {
    "structure.mesh": "mesh",
    "structure.cp_hooks": "hooks",
    "structure.processor_config": "procs",
    "structure.tp_shards": "shards",
    "parity.forward": "fwd",
    "parity.grads": "grads",
}
CELL = {"pass": "ok", "fail": "FAIL", "skip": "-", None: " "}
FAILING = ("fail", "error", "missed")


def ranks_text(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    ranks, out, i = sorted(set(ranks)), [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(out)


def merge_checks(rank_results: list[dict]) -> list[dict]:
    merged = []
    for check_id in CHECK_IDS:
        per_rank = [(r["rank"], c) for r in rank_results for c in r.get("checks", []) if c["id"] == check_id]
        if not per_rank:
            continue
        failed = [rank for rank, c in per_rank if c["status"] == "fail"]
        statuses = {c["status"] for _, c in per_rank}
        status = "fail" if failed else ("pass" if "pass" in statuses else "skip")
        numbers = [c for _, c in per_rank if c.get("max_abs") is not None]
        detail_rank, detail = next(((r, c["detail"]) for r, c in per_rank if c["status"] == "fail"),
                                   next(((r, c["detail"]) for r, c in per_rank if c["detail"]), (None, "")))
        merged.append({
            "id": check_id, "status": status, "failed_ranks": failed,
            "max_abs": max((c["max_abs"] for c in numbers), default=None),
            "max_rel": max((c["max_rel"] for c in numbers), default=None),
            "atol": per_rank[0][1].get("atol"), "rtol": per_rank[0][1].get("rtol"),
            "detail": f"rank {detail_rank}: {detail}" if detail and failed else detail,
        })
    return merged


def merge_case(case: Case, rank_results: list[dict]) -> dict:
    rank_results = sorted(rank_results, key=lambda r: r["rank"])
    statuses = {r["status"] for r in rank_results}
    entry = {"model": case.model, "layout": case.layout.name, "route": rank_results[0].get("route", case.route),
             "control": case.control, "status": "", "reason": "", "checks": [],
             "fit": rank_results[0].get("fit", []), "findings": _findings(rank_results)}
    if "error" in statuses:
        entry.update(status="error", **_error(rank_results))
        entry["checks"] = merge_checks(rank_results)
        return entry
    if statuses == {"skip"}:
        entry.update(status="skip", reason=rank_results[0]["reason"])
        return entry
    if statuses != {"ok"}:
        entry.update(status="error", reason=f"ranks disagree: {sorted(statuses)}")
        return entry
    entry["checks"] = merge_checks(rank_results)
    failing = [c["id"] for c in entry["checks"] if c["status"] == "fail"]
    if case.control:
        must = get_control(case.control).must_trip
        quiet = [c for c in must if c not in failing]
        entry["status"] = "missed" if quiet else "detected"
        entry["reason"] = (f"planted {case.control}; still passing: {', '.join(quiet)}" if quiet
                           else f"planted {case.control}; tripped {', '.join(must)}")
        if case.control == "skip-cp-hooks" and "parity.forward" not in failing:
            entry["reason"] += " (the numbers stayed right: only the structure checks see this bug)"
    else:
        entry["status"] = "fail" if failing else "pass"
        entry["reason"] = f"failed: {', '.join(failing)}" if failing else ""
    return entry


def _findings(rank_results: list[dict]) -> list[str]:
    by_message: dict[str, list[int]] = {}
    for r in rank_results:
        for finding in r.get("findings", []):
            message = finding.split(": ", 1)[-1]
            by_message.setdefault(message, []).append(r["rank"])
    return [f"input not split on ranks {ranks_text(ranks)}: {m}" for m, ranks in by_message.items()]


def _error(rank_results: list[dict]) -> dict:
    errors = [r for r in rank_results if r["status"] == "error"]
    primary = [r for r in errors if not r.get("secondary")] or errors
    root = primary[0]
    secondary = [r["rank"] for r in errors if r.get("secondary")]
    reason = f"rank {root['rank']}: {root['reason']}"
    others = [r["rank"] for r in primary[1:]]
    if others:
        reason += f" (also ranks {ranks_text(others)})"
    if secondary:
        why = "were waiting on it" if root.get("hung") else "failed only because a peer vanished"
        reason += f"; ranks {ranks_text(secondary)} {why}"
    return {"reason": reason, "error_ranks": [r["rank"] for r in primary], "secondary_ranks": secondary,
            "traceback": root.get("traceback", ""), "stacks": {r["rank"]: r["stacks"] for r in errors if r.get("stacks")}}


def summarize(entries: list[dict]) -> dict:
    counts = {"passed": "pass", "failed": "fail", "errors": "error", "skipped": "skip", "detected": "detected",
              "missed": "missed"}
    return {key: sum(e["status"] == status for e in entries) for key, status in counts.items()}


def exit_code(entries: list[dict], events: list) -> int:
    if events:
        return 3
    return 1 if any(e["status"] in FAILING for e in entries) else 0


def replay_command(case: Case, argv_extra: list[str]) -> str:
    args = ["paracheck", "run", "--layouts", case.layout.name, "--route", case.route, *argv_extra]
    fixture = case.factory.startswith("paracheck.fixtures:")
    args += ["--models", case.model] if fixture else ["--spec", case.factory]
    if case.control:
        args += ["--controls", "--only-control", case.control]
    if case.layout.order != "cp-fastest":
        args += ["--order", case.layout.order]
    return " ".join(shlex.quote(a) for a in args)


def table(entries: list[dict]) -> str:
    with_controls = any(e["control"] for e in entries)
    head = ["model", "layout", "route"] + (["control"] if with_controls else []) + list(SHORT_NAMES.values()) + \
        ["max_abs", "max_rel", "failed ranks", "status"]
    rows = [head]
    for e in entries:
        if e["control"] and e["status"] == "skip":
            continue  # listed once per control under the table
        checks = {c["id"]: c for c in e["checks"]}
        fwd = checks.get("parity.forward", {})
        failed = sorted({r for c in e["checks"] for r in c["failed_ranks"]} | set(e.get("error_ranks", [])))
        row = [e["model"], e["layout"], e["route"]] + ([e["control"] or ""] if with_controls else [])
        row += [CELL[checks.get(cid, {}).get("status")] for cid in SHORT_NAMES]
        row += [_num(fwd.get("max_abs")), _num(fwd.get("max_rel")), ranks_text(failed) or "", e["status"].upper()
                if e["status"] in FAILING else e["status"]]
        rows.append(row)
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def notes(entries: list[dict], replays: list[str]) -> str:
    out = []
    plain_skips = {(e["model"], e["layout"]) for e in entries if not e["control"] and e["status"] == "skip"}
    control_skips: dict[tuple[str, str], list[str]] = {}
    for e, replay in zip(entries, replays):
        label = f"{e['model']} {e['layout']} {e['route']}" + (f" [{e['control']}]" if e["control"] else "")
        if e["status"] == "skip" and e["control"]:
            if (e["model"], e["layout"]) not in plain_skips:
                control_skips.setdefault((e["control"], e["reason"]), []).append(f"{e['model']} {e['layout']}")
            continue
        if e["status"] == "skip":
            out.append(f"skip  {label}: {e['reason']}")
            continue
        if e["status"] in FAILING:
            out.append(f"{e['status'].upper():5} {label}: {e['reason']}")
            for c in e["checks"]:
                if c["status"] == "fail" and c["detail"] and e["status"] != "missed":
                    out.append(f"      {c['id']} failed on ranks {ranks_text(c['failed_ranks'])}: {c['detail']}")
            if e.get("traceback"):
                out.append("      " + e["traceback"].strip().splitlines()[-1])
            out.append(f"      replay: {replay}")
        for finding in e["findings"]:
            out.append(f"note  {label}: {finding}")
    for (control, reason), where in control_skips.items():
        out.append(f"skip  control {control} on {', '.join(where)}: {reason}")
    return "\n".join(out)


def _num(value) -> str:
    return "" if value is None else f"{value:.1e}"


def to_json(entries: list[dict], meta: dict, events: list) -> dict:
    cases = []
    for e in entries:
        case = {k: e[k] for k in ("model", "layout", "route", "control", "status", "reason", "checks")}
        case.update({k: e[k] for k in ("fit", "findings", "error_ranks", "secondary_ranks", "traceback", "stacks")
                     if k in e})
        cases.append(case)
    return dict(meta, cases=cases, summary=summarize(entries), events=[e.__dict__ for e in events],
                exit_code=exit_code(entries, events))


def to_junit(entries: list[dict]) -> str:
    lines = []
    for e in entries:
        name = f"{e['model']}-{e['layout']}-{e['route']}" + (f"-{e['control']}" if e["control"] else "")
        lines.append(f"  <testcase classname=\"paracheck\" name={quoteattr(name)}>")
        if e["status"] == "skip":
            lines.append(f"    <skipped message={quoteattr(e['reason'])}/>")
        elif e["status"] in ("fail", "missed"):
            lines.append(f"    <failure message={quoteattr(e['reason'])}>{escape(json.dumps(e['checks'], indent=1))}</failure>")
        elif e["status"] == "error":
            lines.append(f"    <error message={quoteattr(e['reason'])}>{escape(e.get('traceback', ''))}</error>")
        lines.append("  </testcase>")
    s = summarize(entries)
    head = (f"<testsuite name=\"paracheck\" tests=\"{len(entries)}\" failures=\"{s['failed'] + s['missed']}\" "
            f"errors=\"{s['errors']}\" skipped=\"{s['skipped']}\">")
    return "\n".join(['<?xml version="1.0" encoding="utf-8"?>', head, *lines, "</testsuite>", ""])
