"""Two JSON reports of the same command compared case by case, timings and memory left out: whether a change left
what a run reports unchanged (issue 40: the default run's, a `--controls` run's, a sweep shard's, before and after).

    python scripts/compare_reports.py BEFORE.json AFTER.json [--only localization]

Prints each case whose fields differ (the field paths, the first few), the cases one report has and the other lacks,
and per report how many cases it holds and how many carry each localization part. Exits 0 when every case is
the same, 1 otherwise. `--only KEY`: compare that field of each case alone (e.g. `localization`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter

#: Fields that change from run to run whatever the code, at any depth: how long and how much memory it took.
VOLATILE = {"seconds", "timings", "peak_rss_mb", "rss_mb", "cpu_seconds", "threads", "process_groups"}


def differences(a, b, path: str = "") -> list[str]:
    """The paths at which two JSON values differ (NaN equals NaN; the `VOLATILE` fields left out)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted((set(a) | set(b)) - VOLATILE, key=str)
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--only", help="compare this field of each case alone")
    args = parser.parse_args(argv)
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
