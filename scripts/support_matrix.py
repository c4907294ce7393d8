"""Write the support matrices (docs/support-matrix.md; with --tasks-out, the causal LMs there and every other task's
in docs/support-matrix-tasks.md) from the JSON reports of `paracheck run --models transformers:all`.

    python3 scripts/support_matrix.py REPORT.json [MORE.json ...] [--out docs/support-matrix.md]
        [--tasks-out docs/support-matrix-tasks.md] [--wall SECONDS]

Several reports (the `--shard I/N` slices, a `--resume`d run; `.json.gz` ones too) merge, a later report's case
replacing an earlier one's. Each family x layout cell reads from its plain case: `pass`; `xfail` (a declared upstream failure,
linked to the reproduction its known-failures entry names under docs/upstream/); `refused` (skipped before
launch or by transformers, with the reason as a footnote); `FAIL` / `error` (what the kit must still explain).
A layout where a control was not detected is marked `missed`.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import Counter

from paracheck.adapters.transformers.tasks import TASKS, by_suffix
from paracheck.domain.records import passed_beyond

_ORDER = ("tp4", "fsdp4", "dpr4", "pp4", "ep4", "dpr2xfsdp2", "tp2xdpr2", "tp2xfsdp2", "pp2xtp2", "tp2xep2",
          "tp2xfsdp2xep2", "fsdp4xep2", "fsdp4xep4", "tp4xep4", "dpr2xfsdp2xep2", "pp2xdpr2", "pp2xfsdp2")
_LINK = re.compile(r"docs/upstream/([\w.-]+\.md)")


def merged(paths: list[str]) -> tuple[dict, dict]:
    """(case id -> case, the last report's run metadata) over every report, later reports winning."""
    cases, meta = {}, {}
    for path in paths:
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as handle:
            data = json.load(handle)
        meta = {k: v for k, v in data.items() if k not in ("cases", "summary", "events")}
        for case in data["cases"]:
            cases[case["id"]] = case
    return cases, meta


def cells(cases: dict) -> tuple[dict, dict]:
    """((family, layout) -> (status, reason)) from the plain cases, and which cells had a missed control."""
    table, missed = {}, Counter()
    for case in cases.values():
        key = (case["model"], case["layout"])
        if case["control"]:
            missed[key] += case["status"] == "missed"
        else:
            table[key] = (case["status"], case.get("reason", ""), case.get("known_failure", ""))
    return table, missed


#: The passes a family takes on one layout of each kind (every layout with --all), each a column after the layouts:
#: (column, check id, the words for a task that does not take it).
LATER = (("generate", "parity.generate", "does not generate"), ("steps", "parity.steps", ""),
         ("checkpoint", "checkpoint.roundtrip", ""))


def later(cases: dict, check_id: str) -> dict:
    """family -> its cell for one pass the sweep runs on some layouts: `pass (n)` over the n layouts that took it,
    or each layout that did not pass (`xfail` where the case's failure is declared, `FAIL` where it is not, `skip`
    where the pass did not run), or passed only beyond the reference's precision (`beyond`)."""
    by_family: dict[str, list[tuple[str, str]]] = {}
    for case in cases.values():
        check = next((k for k in case.get("checks", []) if k["id"] == check_id), None)
        if case["control"] or check is None:
            continue
        status = check["status"]
        if status == "fail":
            status = "xfail" if case["status"] == "xfail" else "FAIL"
        elif status == "pass" and passed_beyond(check.get("data", {}).get("per_rank")):
            status = "beyond"
        by_family.setdefault(case["model"], []).append((case["layout"], status))
    out = {}
    for family, held in by_family.items():
        other = [f"{status} {layout}" for layout, status in sorted(held) if status != "pass"]
        out[family] = f"pass ({len(held)})" if not other else ", ".join(other) + f" (of {len(held)})"
    return out


def render(cases: dict, meta: dict, wall: float | None, source: str = "") -> str:
    """The matrix of every family `cases` holds: its header (`source`: where the reports come from, quoted), a row
    per family, the reasons' footnotes."""
    table, missed = cells(cases)
    order = {task.name: n for n, task in enumerate(TASKS)}
    families = sorted({f for f, _ in table}, key=lambda f: (order[by_suffix(f)[1].name], f))
    layouts = sorted({l for _, l in table}, key=lambda l: (_ORDER.index(l) if l in _ORDER else 99, l))
    passes = {column: later(cases, check) for column, check, _ in LATER}
    notes: dict[str, int] = {}
    rows = []
    for family in families:
        task = by_suffix(family)[1]
        row = [family, task.name]
        for layout in layouts:
            status, reason, known = table.get((family, layout), ("", "", ""))
            row.append(_cell(status, reason, known, notes) + (" (missed control)" if missed[family, layout] else ""))
        row += [words if column == "generate" and not task.generates else passes[column].get(family, "")
                for column, _, words in LATER]
        rows.append(row)
    out = _header(cases, meta, wall, table, families, source)
    out += ["| family | task | " + " | ".join(layouts + [c for c, _, _ in LATER]) + " |",
            "| --- | --- | " + " | ".join("---" for _ in layouts + list(LATER)) + " |"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    if notes:
        out += ["", "## Reasons", ""] + [f"{n}. {text}" for text, n in sorted(notes.items(), key=lambda x: x[1])]
    return "\n".join(out) + "\n"


def _header(cases: dict, meta: dict, wall: float | None, table: dict, families: list, source: str = "") -> list[str]:
    counts = Counter(status for status, _, _ in table.values())
    by_family = Counter(_family_status([table[k][0] for k in table if k[0] == f]) for f in families)
    by_task = Counter(by_suffix(f)[1].name for f in families)
    versions = meta.get("versions", {})
    return ["# Support matrix: every transformers model class with a TP plan", "",
            "Generated by `scripts/support_matrix.py` from the JSON reports of `paracheck run --models transformers:all` "
            "(do not edit by hand). Each family is its config class's defaults shrunk to a tiny model and fitted to 4 "
            "ranks by `paracheck.adapters.transformers.fitting`, and named by its model type and task (`llama` the causal "
            "LM, `llama-seq-cls`, `llava-image-text`: `paracheck.adapters.transformers.tasks`); each cell is the plain "
            "case of that layout. "
            + (f"{sum(1 for c in cases.values() if c['control'])} control cases ran; a cell whose control was not "
               "detected says so." if any(c["control"] for c in cases.values()) else
               "This report ran no controls (`--controls` adds them).") +
            " `refused`: skipped with the reason (the fitting rule, a plan transformers refuses, or a family that "
            "cannot be built); `error` / `FAIL`: not yet explained (each reason is below).", "",
            f"transformers {versions.get('transformers', '?')}, torch {versions.get('torch', '?')}, backend "
            f"{meta.get('backend', '?')}, {meta.get('nproc', '?')} ranks.", "", *([source, ""] if source else []),
            f"**{len(families)} families, {len(table)} family x layout cases: " +
            ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + "**; families: " +
            ", ".join(f"{n} {s}" for s, n in sorted(by_family.items())) + "; by task: " +
            ", ".join(f"{by_task[t.name]} {t.name}" for t in TASKS if by_task[t.name]) + "." +
            (f" Wall time {wall / 60:.1f} min." if wall else ""), "",
            "The last three columns are the passes a family takes on one layout of each kind of parallelism (every "
            "layout with `--all`), each as `pass (n)` over the n layouts that took it, or each layout that did not "
            "pass (`xfail`: the case's failure is declared; `beyond`: it passed only within the single-device "
            "reference's own imprecision, its float32 steps too far from the same steps in float64 for the tolerance "
            "to judge the run, docs/reports.md): `generate`, parity.generate (greedy generation in three "
            "cache modes); `steps`, parity.steps (the library's Trainer, optimizer steps against one process's); "
            "`checkpoint`, checkpoint.roundtrip (save, reload in one process and on another layout, resume). An "
            "empty cell: no case of the family reached that pass (the sweep ran without it, `--steps 0`, "
            "`--no-checkpoint`, or every case ended before it).", ""]


def _cell(status: str, reason: str, known: str, notes: dict) -> str:
    if status in ("pass", ""):
        return status
    if status in ("xfail", "xpass"):
        link = _LINK.search(known or reason or "")
        return f"[{status}](upstream/{link.group(1)})" if link else status
    label = {"skip": "refused"}.get(status, status.upper() if status == "fail" else status)
    text = (reason or "").replace("|", "/").replace("\n", " ")[:300]
    n = notes.setdefault(text, len(notes) + 1)
    return f"{label} [{n}]"


def _family_status(statuses: list[str]) -> str:
    if any(s in ("fail", "error") for s in statuses):
        return "with failures"
    if all(s == "skip" for s in statuses):
        return "refused"
    return "clean"


def by_task(cases: dict, causal: bool) -> dict:
    """The cases of the causal-LM families (`causal`), or of every other task's."""
    return {k: c for k, c in cases.items() if (by_suffix(c["model"])[1] is TASKS[0]) == causal}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+")
    parser.add_argument("--out", default="docs/support-matrix.md")
    parser.add_argument("--tasks-out", help="write the causal-LM families to --out and every other task's here "
                                            "(docs/support-matrix-tasks.md), from the same reports")
    parser.add_argument("--wall", type=float, help="the sweep's wall time in seconds, quoted in the header")
    parser.add_argument("--source", default="", help="where the reports come from (the commit, any reruns merged "
                                                     "after the shards), quoted in the header")
    args = parser.parse_args(argv)
    cases, meta = merged(args.reports)
    outputs = [(args.out, cases)] if not args.tasks_out else [(args.out, by_task(cases, True)),
                                                              (args.tasks_out, by_task(cases, False))]
    for path, held in outputs:
        text = render(held, meta, args.wall, args.source)
        with open(path, "w") as handle:
            handle.write(text)
        print(path, next(line for line in text.splitlines() if line.startswith("**")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
