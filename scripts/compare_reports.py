"""Two JSON reports of the same command compared case by case, timings and memory left out: whether a change left
what a run reports unchanged (issue 40: the default run's, a `--controls` run's, a sweep shard's, before and after).

    python scripts/compare_reports.py BEFORE.json AFTER.json [--only localization]
    python scripts/compare_reports.py --html BEFORE_TREE REPORT.json [REPORT.json ...]

Prints each case whose fields differ (the field paths, the first few), the cases one report has and the other lacks,
and per report how many cases it holds and how many carry each localization part. Exits 0 when every case is
the same, 1 otherwise. `--only KEY`: compare that field of each case alone (e.g. `localization`).

`--html BEFORE_TREE`: the HTML page of each report, drawn by the paracheck whose source tree is BEFORE_TREE (a folder
holding `paracheck/`, e.g. an exported older commit) and by this checkout's, compared byte for byte: whether a change
to the renderer left the page of every existing report as it was. Prints each report's verdict (the first differing
line where they differ); exits 0 when every page is the same.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

#: Fields that change from run to run whatever the code, at any depth: how long and how much memory it took.
VOLATILE = {"seconds", "timings", "peak_rss_mb", "rss_mb", "cpu_seconds", "threads", "process_groups"}
#: Fields a change added on purpose (docs/reports.md): one the first report lacks and the second has is no difference
#: (issue 40: a case's findings as records beside their lines).
ADDED = {"findings_seen"}


def differences(a, b, path: str = "") -> list[str]:
    """The paths at which two JSON values differ (NaN equals NaN; the `VOLATILE` fields left out)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted((set(a) | set(b)) - VOLATILE - (ADDED & (set(b) - set(a))), key=str)
                for d in ([f"{path}.{k}: only in one"] if (k in a) != (k in b)
                          else differences(a[k], b[k], f"{path}.{k}"))]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items, then {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return []
    return [] if a == b and type(a) is type(b) else [f"{path}: {a!r:.60} then {b!r:.60}"]


def cases(path: str, only: str | None) -> dict:
    with open(path) as handle:
        report = json.load(handle)
    out = {}
    for case in report.get("cases", []):
        out[case.get("id")] = case.get(only) if only else case
    return out


def parts(held: dict, only: str | None) -> Counter:
    """How many cases carry each localization part."""
    found = [c if only == "localization" else c.get("localization") if isinstance(c, dict) else None
             for c in held.values()]
    return Counter(p for loc in found if isinstance(loc, dict) for p in loc)


#: This checkout's source tree (the folder holding `paracheck/`).
HERE = Path(__file__).resolve().parents[1]
#: Draws a report's page with whichever paracheck PYTHONPATH names (a process per tree, so the two never mix).
DRAW = ("import json, sys\nfrom paracheck.results import html\n"
        "with open(sys.argv[1]) as f:\n    sys.stdout.write(html.render(json.load(f)))\n")


def page(tree: Path, report: str) -> str:
    report = os.path.abspath(report)  # the child runs in `tree`: a relative path would name another file there
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, "-c", DRAW, report], env=env, capture_output=True, text=True, cwd=tree)
    if out.returncode:
        raise SystemExit(f"drawing {report} with {tree} failed:\n{out.stderr[-2000:]}")
    return out.stdout


def first_difference(a: str, b: str) -> str:
    for n, (x, y) in enumerate(zip(a.splitlines(), b.splitlines()), 1):
        if x != y:
            at = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            return f"line {n}, column {at + 1}: {x[max(0, at - 60):at + 60]!r} then {y[max(0, at - 60):at + 60]!r}"
    return f"{len(a.splitlines())} lines, then {len(b.splitlines())}"


def compare_pages(before_tree: str, reports: list[str]) -> int:
    differing = 0
    for report in reports:
        before, after = page(Path(before_tree).resolve(), report), page(HERE, report)
        same = before == after
        differing += not same
        print(f"{report}: {len(after)} characters, " + ("the same page" if same else
                                                       f"differs at {first_difference(before, after)}"))
    print("same" if not differing else f"{differing} of {len(reports)} pages differ")
    return 0 if not differing else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", help="the first report (with --html: the first report to draw)")
    parser.add_argument("after", nargs="+", help="the second report (with --html: more reports to draw)")
    parser.add_argument("--only", help="compare this field of each case alone")
    parser.add_argument("--html", metavar="BEFORE_TREE",
                        help="compare the pages drawn by BEFORE_TREE and by this checkout")
    args = parser.parse_args(argv)
    if args.html:
        return compare_pages(args.html, [args.before, *args.after])
    if len(args.after) != 1:
        parser.error("compare two reports (or draw pages with --html)")
    args.after = args.after[0]
    before, after = cases(args.before, args.only), cases(args.after, args.only)
    differing = 0
    for case in sorted(set(before) | set(after), key=str):
        if case not in before or case not in after:
            print(f"{case}: only in {'the first' if case in before else 'the second'} report")
            differing += 1
            continue
        found = differences(before[case], after[case])
        if found:
            differing += 1
            print(f"{case}: {len(found)} differences, e.g. " + "; ".join(found[:3]))
    for name, held in (("before", before), ("after", after)):
        counted = ", ".join(f"{n} {p}" for p, n in sorted(parts(held, args.only).items()))
        print(f"{name}: {len(held)} cases; localization parts: {counted or 'none'}")
    print("same" if not differing else f"{differing} cases differ")
    return 0 if not differing else 1


if __name__ == "__main__":
    sys.exit(main())
