"""The margin between noise and a bug at reduced precision, per model: one real gloo run per dtype.

    python benchmarks/dtype_table.py [--dtypes bf16,fp16] [--layouts u4,r4,tp2xu2] [--models all]

For each dtype it runs `paracheck run --controls --variants base` and prints, per model and check
(forward, grads): the clean cases' worst error against the fp32 reference, the single-device run's
own error at that dtype, the bound the reduced-precision rule allowed, and the worst error / bound;
then, among the controls that tripped that check, the smallest error and the smallest error / bound.
Clean cases must stay below 1 in the first ratio; the second says how far the weakest control lands
above its bound (for grads: the parameter furthest over its own bound).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict

CHECKS = ("parity.forward", "parity.grads")


def run(dtype: str, layouts: str, models: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "r.json")
        proc = subprocess.run([sys.executable, "-m", "paracheck", "run", "--controls", "--variants", "base", "--quiet",
                               "--dtype", dtype, "--layouts", layouts, "--models", models, "--report-json", path],
                              capture_output=True, text=True)
        if not os.path.exists(path):
            raise SystemExit(f"paracheck exited {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        with open(path) as handle:
            return json.load(handle)


def table(report: dict) -> dict:
    """(model, check) -> the clean cases' worst error, single-device error, bound and error/bound; the
    smallest error and error/bound among the controls that tripped the check; controls detected / judged."""
    rows = defaultdict(lambda: {"clean": 0.0, "own": 0.0, "bound": None, "clean_ratio": None,
                                "control": None, "control_ratio": None, "detected": 0, "controls": 0})
    for case in report["cases"]:
        for check in case["checks"]:
            if check["id"] not in CHECKS or check.get("max_abs") is None:
                continue
            row = rows[(case["model"], check["id"])]
            ranks = list(((check.get("data") or {}).get("per_rank") or {}).values())
            ratio = max((r.get("ratio", 0.0) for r in ranks), default=None)
            # A passing check on a plain case is noise; an xfail case's failing check is an upstream bug.
            if case["control"] is None and (check["status"] == "pass" or case["status"] == "fail"):
                row["clean"] = max(row["clean"], check["max_abs"])
                row["own"] = max([row["own"]] + [r.get("single_device_error", 0.0) for r in ranks])
                row["bound"] = max([row["bound"] or 0.0] + [r.get("bound", 0.0) for r in ranks])
                row["clean_ratio"] = _worst(max, row["clean_ratio"], ratio)
            elif case["control"] is not None and check["status"] == "fail":
                row["control"] = _worst(min, row["control"], check["max_abs"])
                row["control_ratio"] = _worst(min, row["control_ratio"], ratio)
    for case in report["cases"]:
        if case["control"] is not None and case["status"] in ("detected", "missed"):
            for check_id in CHECKS:
                row = rows[(case["model"], check_id)]
                row["controls"] += 1
                row["detected"] += case["status"] == "detected"
    return rows


def _worst(pick, current, new):
    return new if current is None else current if new is None else pick(current, new)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="bf16,fp16")
    parser.add_argument("--layouts", default="u4,r4,tp2xu2")
    parser.add_argument("--models", default="all")
    args = parser.parse_args()
    print(f"{'dtype':5} {'model':12} {'check':15} {'clean':>8} {'1-device':>8} {'bound':>8} {'/bound':>6} "
          f"{'min ctrl':>8} {'/bound':>6}  detected")
    for dtype in args.dtypes.split(","):
        report = run(dtype, args.layouts, args.models)
        for (model, check), r in sorted(table(report).items()):
            num = lambda x: f"{x:8.1e}" if x is not None else f"{'-':>8}"
            times = lambda x: f"{x:6.2f}" if x is not None else f"{'-':>6}"
            print(f"{dtype:5} {model:12} {check:15} {num(r['clean'])} {num(r['own'])} {num(r['bound'])} "
                  f"{times(r['clean_ratio'])} {num(r['control'])} {times(r['control_ratio'])}  "
                  f"{r['detected']}/{r['controls']}")
        print(f"{dtype}: exit {report['exit_code']}, {report['summary']}")


if __name__ == "__main__":
    main()
