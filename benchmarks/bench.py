"""Where a run's time goes, as ratios, with real gloo runs (no timed assertions anywhere).

    python benchmarks/bench.py [--repeat 3] [--nproc 4] [--skip-per-case] [--per-case-sample N]
                               [--extra "ARGS"] [--keep-report PATH]

(a) the default `paracheck run`; (c) the floor: `--nproc` processes that import torch, diffusers and transformers and
exit; (b) the cases (a) ran, one launch each with fresh interpreters (what a `torch.multiprocessing.spawn`
per test costs, as diffusers' own mixins do). Prints a/c and b/a (medians), the split of (a) into start,
references, parallel runs, checks and reporting, and each rank's peak resident memory over the run.

Wall-clock seconds measure the machine as much as the code when other jobs share it, so everything is
also given in CPU seconds: (b) and (c) as their processes' user + system time, (a) as the launcher's plus
every rank's (each rank reports its own in the JSON, `cpu_seconds`; forked ranks are not the launcher's
waited children, so the operating system's accounting misses them). The fork server's one import of torch and
diffusers is in neither, about one process of (c). The phase split gives wall and CPU seconds, and memory
is given as each rank's peak and its resident size now, after the first and the last case.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

#: What every rank needs imported: the import floor (the cost goal is the default run at most 4 times it).
FLOOR = "import torch, diffusers, diffusers.models.transformers, transformers"


def children_cpu() -> float:
    """User + system seconds of this process's waited-for children so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(cmd: list[str], env=None) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the command's own process and the children it waited for)."""
    start, cpu = time.perf_counter(), children_cpu()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **(env or {})))
    elapsed, cpu = time.perf_counter() - start, children_cpu() - cpu
    if proc.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return elapsed, cpu


def floor(nproc: int) -> tuple[float, float]:
    start, cpu = time.perf_counter(), children_cpu()
    procs = [subprocess.Popen([sys.executable, "-c", FLOOR]) for _ in range(nproc)]
    for p in procs:
        p.wait()
    return time.perf_counter() - start, children_cpu() - cpu


def default_run(nproc: int, extra: list[str]) -> tuple[float, float, dict]:
    """(wall seconds, CPU seconds of the launcher and every rank, the JSON report)."""
    report = os.path.join(tempfile.mkdtemp(), "r.json")
    seconds, launcher_cpu = timed([sys.executable, "-m", "paracheck", "run", "--nproc", str(nproc), "--quiet",
                                   "--report-json", report, *extra])
    with open(report) as handle:
        data = json.load(handle)
    return seconds, launcher_cpu + ranks_cpu(data), data


def ranks_cpu(report: dict) -> float:
    """Every rank's CPU seconds, summed: each rank's count grows case by case and starts again in a new
    world, so the rises are added up."""
    total, last = 0.0, {}
    for case in report["cases"]:
        for rank, seconds in enumerate(case.get("cpu_seconds") or []):
            total += seconds - last.get(rank, 0.0) if seconds >= last.get(rank, 0.0) else seconds
            last[rank] = seconds
    return total


def per_case(report: dict, nproc: int, sample: int | None) -> tuple[float, float, int, int]:
    """The cases (a) ran, each in its own launch of fresh interpreters: (seconds, CPU seconds, cases timed,
    cases ran); with `sample`, only every k-th case is timed and the totals scaled up. Fresh ranks are the
    launcher's waited children, so their CPU is counted."""
    ran = [c for c in report["cases"] if c["status"] != "skip" and not c["control"]]
    timed_cases = ran[::max(1, len(ran) // sample)][:sample] if sample else ran
    wall = cpu = 0.0
    for case in timed_cases:
        args = ["--nproc", str(nproc), "--models", case["model"], "--layouts", case["layout"], "--variants",
                case["variant"], "--quiet"]
        seconds, used = timed([sys.executable, "-m", "paracheck", "run", *args], env={"PARACHECK_START": "fresh"})
        wall, cpu = wall + seconds, cpu + used
    scale = len(ran) / max(len(timed_cases), 1)
    return wall * scale, cpu * scale, len(timed_cases), len(ran)


def split(seconds: float, report: dict) -> dict:
    """Phase -> (wall seconds, CPU seconds), summed over cases, the slowest rank's each (no CPU for start)."""
    phases = {"start": (report.get("start_seconds", 0.0), None)}
    for name in ("reference", "parallel", "checks"):
        phases[name] = tuple(sum(c.get("timings", {}).get(key, 0.0) for c in report["cases"])
                             for key in (name, f"{name}_cpu"))
    phases["reporting and the rest"] = (max(seconds - sum(w for w, _ in phases.values()), 0.0), None)
    return phases


def memory(report: dict) -> list[str]:
    """Each rank's peak and resident memory, threads and process groups after the first and the last case
    that ran, and the most threads any rank had after any case."""
    ran = [c for c in report["cases"] if c.get("peak_rss_mb")]
    if not ran:
        return []
    lines = []
    for key, what in (("peak_rss_mb", "peak MiB"), ("rss_mb", "resident MiB"), ("threads", "threads"),
                      ("process_groups", "groups")):
        first, last = ran[0].get(key) or [], ran[-1].get(key) or []
        if first and last:
            pairs = ", ".join(f"{a:.0f}->{b:.0f}" for a, b in zip(first, last))
            lines.append(f"  {what:12} per rank, first case -> last case: {pairs}")
    most = max((t for c in ran for t in c.get("threads") or []), default=None)
    if most is not None:
        lines.append(f"  threads at most (any rank, any case): {most}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--skip-per-case", action="store_true", help="leave out (b), the slowest part")
    parser.add_argument("--per-case-sample", type=int, default=None,
                        help="time (b) on this many of the cases and scale up (it is said in the output)")
    parser.add_argument("--extra", default="", help="extra `paracheck run` arguments for (a), space separated")
    parser.add_argument("--keep-report", default=None, help="also write (a)'s JSON report (the first run's) here")
    args = parser.parse_args()
    extra = args.extra.split()
    # (a) and (c) alternate, so a change in the machine's load falls on both; the ratio is the median of the
    # ratios of each pair.
    runs, floors = [], []
    for _ in range(args.repeat):
        runs.append(default_run(args.nproc, extra))
        floors.append(floor(args.nproc))
    a, a_cpu = statistics.median(s for s, _, _ in runs), statistics.median(c for _, c, _ in runs)
    pair_ratio = statistics.median(r[0] / f[0] for r, f in zip(runs, floors))
    report = runs[0][2]
    statuses = {}
    for case in report["cases"]:
        statuses[case["status"]] = statuses.get(case["status"], 0) + 1
    if not statuses.get("pass"):
        # An install that cannot import the fixtures makes every case an error in seconds: no ratio to print.
        first = next((c["reason"] for c in report["cases"] if c["status"] == "error"), "")
        raise SystemExit(f"(a) passed no case ({statuses}); first error: {first}")
    if args.keep_report:
        with open(args.keep_report, "w") as handle:
            json.dump(report, handle)
    c, c_cpu = statistics.median(s for s, _ in floors), statistics.median(u for _, u in floors)
    ran = sum(1 for x in report["cases"] if x["status"] != "skip")
    print(f"(a) default run: {a:.1f}s, {a_cpu:.1f} CPU s, for {len(report['cases'])} cases ({ran} ran, "
          f"{report.get('references')} references, ranks {report.get('start_method')}; "
          + ", ".join(f"{n} {status}" for status, n in sorted(statuses.items())) + ")")
    print(f"(c) floor, {args.nproc} processes importing torch+diffusers+transformers: {c:.1f}s, {c_cpu:.1f} CPU s")
    print(f"a/c = {pair_ratio:.2f} (wall, median of {args.repeat} alternating pairs; goal <= 4), "
          f"{a_cpu / c_cpu:.2f} (CPU)")
    if not args.skip_per_case:
        b, b_cpu, timed_cases, ran = per_case(report, args.nproc, args.per_case_sample)
        how = "" if timed_cases == ran else f" (timed {timed_cases} of {ran} cases, scaled up)"
        print(f"(b) one launch per plain case, fresh interpreters: {b:.1f}s, {b_cpu:.1f} CPU s{how};  "
              f"b/a = {b / a:.2f} (wall), {b_cpu / a_cpu:.2f} (CPU)")
    print("\nsplit of (a), seconds summed over cases (slowest rank each), wall and CPU:")
    for name, (wall, cpu) in split(a, report).items():
        print(f"  {name:24} {wall:6.1f}  {'' if cpu is None else f'{cpu:6.1f}'}")
    lines = memory(report)
    if lines:
        print("\nmemory, threads and process groups of (a):")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
