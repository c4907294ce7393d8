"""What localization adds to a failing case: the same controls run with and without it (no timed assertions).

    python benchmarks/localize_cost.py [--repeat 2] [--args "--models flux --layouts tp2xr2 --variants base"]

Runs `paracheck run ARGS --controls` as its own process twice per repeat, once with `PARACHECK_LOCALIZE=0`,
and compares, over the detected controls whose checks failed on numbers (the ones localization reruns): the
sum of their wall seconds (slowest rank), of their CPU seconds (every rank's own phases), and the
`localize` phase each case reports (`timings.localize`, `localize_cpu`). Passing cases pay one all-reduce of
four flags: the plain cases' wall seconds are given both ways too.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(args: list[str], localize: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "r.json")
        env = dict(os.environ, PARACHECK_LOCALIZE="1" if localize else "0")
        subprocess.run([sys.executable, "-m", "paracheck", "run", *args, "--controls", "--report-json", report,
                        "--quiet"], cwd=ROOT, env=env, check=False, capture_output=True)
        with open(report) as f:
            return json.load(f)


def figures(report: dict, names: set | None) -> dict:
    failing = [c for c in report["cases"] if c["control"] and c["status"] == "detected"
               and any(k["id"].startswith("parity.") and k["status"] == "fail" for k in c["checks"])
               and (names is None or (c["layout"], c["control"]) in names)]
    plain = [c for c in report["cases"] if not c["control"] and c["status"] != "skip"]

    def cpu(c):
        return sum(v for k, v in c["timings"].items() if k.endswith("_cpu"))

    return {"cases": {(c["layout"], c["control"]) for c in failing},
            "wall": sum(c["seconds"] for c in failing), "cpu": sum(cpu(c) for c in failing),
            "localize": sum(c["timings"].get("localize", 0.0) for c in failing),
            "localize_cpu": sum(c["timings"].get("localize_cpu", 0.0) for c in failing),
            "plain_wall": sum(c["seconds"] for c in plain)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--args", default="--models flux --layouts tp2xr2 --variants base")
    opts = parser.parse_args()
    args = opts.args.split()
    on, off = [], []
    for _ in range(opts.repeat):
        with_it = figures(run(args, True), None)
        on.append(with_it)
        off.append(figures(run(args, False), with_it["cases"]))
    med = {k: statistics.median(r[k] for r in on) for k in ("wall", "cpu", "localize", "localize_cpu", "plain_wall")}
    base = {k: statistics.median(r[k] for r in off) for k in ("wall", "cpu", "plain_wall")}
    n = len(on[0]["cases"])
    print(f"{n} failing control cases ({opts.args}), medians of {opts.repeat}:")
    print(f"  wall (slowest rank): {base['wall']:.1f} s without localization, {med['wall']:.1f} s with "
          f"(+{med['wall'] / base['wall'] - 1:.0%}); the localize phase {med['localize']:.1f} s, "
          f"{med['localize'] / n:.2f} s a case")
    print(f"  CPU (rank 0's phases summed, per case's slowest): {base['cpu']:.1f} s without, {med['cpu']:.1f} s with; "
          f"the localize phase {med['localize_cpu']:.1f} s")
    print(f"  plain cases' wall: {base['plain_wall']:.1f} s without, {med['plain_wall']:.1f} s with")


if __name__ == "__main__":
    main()
