"""The margin between noise and a bug at reduced precision, per model: one real gloo run per dtype.

    python benchmarks/dtype_table.py [--dtypes bf16,fp16] [--layouts u4,tp2xu2] [--models all]

For each dtype it runs `paracheck run --controls --variants base` and prints, per model and check
(forward, grads): the clean cases' worst error against the fp32 reference, the single-device run's
own error at that dtype, the bound the reduced-precision rule allowed, and the smallest error among
the controls that must trip that check. A control is only as visible as that last column is above
the bound.
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
    """(model, check) -> clean error, single-device error, bound, smallest control error that failed the check,
    and the model's controls detected / judged (the same on both of its rows)."""
    rows = defaultdict(lambda: {"clean": 0.0, "own": 0.0, "bound": None, "control": None, "detected": 0, "controls": 0})
    for case in report["cases"]:
        for check in case["checks"]:
            if check["id"] not in CHECKS or check.get("max_abs") is None:
                continue
            row = rows[(case["model"], check["id"])]
            data = check.get("data") or {}
            if case["control"] is None and case["status"] in ("pass", "xfail", "fail"):
                row["clean"] = max(row["clean"], check["max_abs"])
                row["own"] = max(row["own"], data.get("single_device_error", 0.0))
                row["bound"] = max(row["bound"] or 0.0, data.get("bound", 0.0))
            elif case["control"] is not None and check["status"] == "fail":
                row["control"] = min(row["control"] or float("inf"), check["max_abs"])
    for case in report["cases"]:
        if case["control"] is not None and case["status"] in ("detected", "missed"):
            for check_id in CHECKS:
                row = rows[(case["model"], check_id)]
                row["controls"] += 1
                row["detected"] += case["status"] == "detected"
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="bf16,fp16")
    parser.add_argument("--layouts", default="u4,tp2xu2")
    parser.add_argument("--models", default="all")
    args = parser.parse_args()
    print(f"{'dtype':5} {'model':12} {'check':15} {'clean':>8} {'1-device':>8} {'bound':>8} {'min ctrl':>8}  detected")
    for dtype in args.dtypes.split(","):
        report = run(dtype, args.layouts, args.models)
        for (model, check), r in sorted(table(report).items()):
            fmt = lambda x: f"{x:8.1e}" if x is not None else f"{'-':>8}"
            print(f"{dtype:5} {model:12} {check:15} {fmt(r['clean'])} {fmt(r['own'])} {fmt(r['bound'])} "
                  f"{fmt(r['control'])}  {r['detected']}/{r['controls']}")
        print(f"{dtype}: exit {report['exit_code']}, {report['summary']}")


if __name__ == "__main__":
    main()
