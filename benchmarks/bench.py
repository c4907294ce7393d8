"""Where a run's time goes, as ratios, with real gloo runs (no timed assertions anywhere).

    python benchmarks/bench.py [--repeat 3] [--nproc 4] [--skip-per-case]

(a) the default `paracheck run`; (c) the floor: `--nproc` processes that import torch and diffusers and
exit; (b) the cases (a) ran, one launch each with fresh interpreters (what a `torch.multiprocessing.spawn`
per test costs, as diffusers' own mixins do). Prints a/c and b/a (medians), the split of (a) into start,
references, parallel runs, checks and reporting, and each rank's peak resident memory over the run.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

FLOOR = "import torch, diffusers, diffusers.models.transformers"


def timed(cmd: list[str], env=None) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **(env or {})))
    elapsed = time.perf_counter() - start
    if proc.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return elapsed


def floor(nproc: int) -> float:
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", FLOOR]) for _ in range(nproc)]
    for p in procs:
        p.wait()
    return time.perf_counter() - start


def default_run(nproc: int, extra: list[str]) -> tuple[float, dict]:
    report = os.path.join(tempfile.mkdtemp(), "r.json")
    seconds = timed([sys.executable, "-m", "paracheck", "run", "--nproc", str(nproc), "--quiet",
                     "--report-json", report, *extra])
    with open(report) as handle:
        return seconds, json.load(handle)


def per_case(report: dict, nproc: int) -> float:
    """Every case (a) ran, each in its own launch of fresh interpreters."""
    total = 0.0
    for case in report["cases"]:
        if case["status"] == "skip" or case["control"]:
            continue
        args = ["--nproc", str(nproc), "--models", case["model"], "--layouts", case["layout"], "--quiet"]
        total += timed([sys.executable, "-m", "paracheck", "run", *args], env={"PARACHECK_START": "fresh"})
    return total


def split(seconds: float, report: dict) -> dict:
    phases = {"start": report.get("start_seconds", 0.0)}
    for name in ("reference", "parallel", "checks"):
        phases[name] = sum(c.get("timings", {}).get(name, 0.0) for c in report["cases"])
    phases["reporting and the rest"] = max(seconds - sum(phases.values()), 0.0)
    return phases


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--skip-per-case", action="store_true", help="leave out (b), the slowest part")
    parser.add_argument("--extra", default="", help="extra `paracheck run` arguments for (a), space separated")
    args = parser.parse_args()
    extra = args.extra.split()
    runs = [default_run(args.nproc, extra) for _ in range(args.repeat)]
    a = statistics.median(s for s, _ in runs)
    report = runs[0][1]
    c = statistics.median(floor(args.nproc) for _ in range(args.repeat))
    ran = sum(1 for x in report["cases"] if x["status"] != "skip")
    print(f"(a) default run: {a:.1f}s for {len(report['cases'])} cases ({ran} ran, {report.get('references')} "
          f"references, ranks {report.get('start_method')})")
    print(f"(c) floor, {args.nproc} processes importing torch+diffusers: {c:.1f}s")
    print(f"a/c = {a / c:.2f}")
    if not args.skip_per_case:
        b = per_case(report, args.nproc)
        print(f"(b) one launch per plain case, fresh interpreters: {b:.1f}s;  b/a = {b / a:.2f}")
    print("\nsplit of (a), seconds summed over cases (slowest rank each):")
    for name, seconds in split(a, report).items():
        print(f"  {name:24} {seconds:6.1f}")
    rss = [x.get("peak_rss_mb") or [] for x in report["cases"] if x.get("peak_rss_mb")]
    if rss:
        first, last = max(rss[0]), max(rss[-1])
        print(f"\npeak resident memory per rank: {first:.0f} MiB after the first case, {last:.0f} MiB after the last")


if __name__ == "__main__":
    main()
