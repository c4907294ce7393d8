"""Where a run's time goes, as ratios, with real gloo runs (no timed assertions anywhere).

    python benchmarks/bench.py [--repeat 3] [--nproc 4] [--skip-per-case] [--per-case-sample N]
                               [--extra "ARGS"] [--keep-report PATH]

The kit's run is the default `paracheck run` (its quick tier, with `parity.steps` and `checkpoint.roundtrip` on one
layout of each kind). Each ratio is issue 31's goal, measured side by side:

(a) the reference style: the cases the kit ran, one launch each with fresh interpreters (what a
    `torch.multiprocessing.spawn` per test costs, as diffusers' own mixins do), against the kit; goal >= 10.
(b) the bare work: the same cases with `PARACHECK_BARE=1`, in the same forked ranks, their reference, parallel
    model, forwards and backward and nothing else (no check, comparison, localization or report of a check),
    against the kit without its training passes (`--steps 0 --no-checkpoint`, work the bare run does not do):
    the kit's overhead, goal <= 25%.
(c) the floor: `--nproc` processes that import torch, diffusers and transformers and exit; the kit against it,
    goal <= 4.
(d) what parity.steps and checkpoint.roundtrip add: the kit against the kit without them.
(e) with `--pipelines`: what the default run's pipeline cases add (one per pipeline, `paracheck run --models
    pipelines` names them): the kit against the kit naming every other fixture, wall and CPU.

The kit, its run without training, the bare run and the floor alternate, so a change in the machine's load falls
on each; each ratio is the median of the ratios of the repeats. Wall-clock seconds measure the machine as much as
the code when other jobs share it, so everything is also given in CPU seconds: (a) and (c) as their processes'
user + system time, the kit's runs as the launcher's plus every rank's (each rank reports its own in the JSON,
`cpu_seconds`; forked ranks are not the launcher's waited children, so the operating system's accounting misses
them). The fork server's one import of torch and diffusers is in neither, about one process of (c). The split
gives wall and CPU seconds by phase, and memory is given as each rank's peak and its resident size now, after the
first and the last case.
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


def default_run(nproc: int, extra: list[str], env: dict | None = None) -> tuple[float, float, dict]:
    """(wall seconds, CPU seconds of the launcher and every rank, the JSON report)."""
    report = os.path.join(tempfile.mkdtemp(), "r.json")
    seconds, launcher_cpu = timed([sys.executable, "-m", "paracheck", "run", "--nproc", str(nproc), "--quiet",
                                   "--report-json", report, *extra], env=env)
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
    for name in ("reference", "parallel", "checks", "localize", "steps", "checkpoint"):
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


def case_seconds(report: dict) -> float:
    """The cases' own seconds (each case's slowest rank, as the JSON gives it), summed: no start, no reporting."""
    return sum(c.get("seconds") or 0.0 for c in report["cases"])


def _paired(runs: list, floors: list) -> float:
    return statistics.median(r[0] / f[0] for r, f in zip(runs, floors))


def _require_passes(report: dict) -> None:
    statuses = _statuses(report)
    if not statuses.get("pass"):
        # An install that cannot import the fixtures makes every case an error in seconds: no ratio to print.
        first = next((c["reason"] for c in report["cases"] if c["status"] == "error"), "")
        raise SystemExit(f"the kit's run passed no case ({statuses}); first error: {first}")


def _statuses(report: dict) -> dict:
    statuses: dict = {}
    for case in report["cases"]:
        statuses[case["status"]] = statuses.get(case["status"], 0) + 1
    return statuses


def _print_kit(seconds: float, cpu: float, report: dict) -> None:
    ran = sum(1 for x in report["cases"] if x["status"] != "skip")
    print(f"kit, the default run: {seconds:.1f}s, {cpu:.1f} CPU s, for {len(report['cases'])} cases ({ran} ran, "
          f"{report.get('references')} references, ranks {report.get('start_method')}; "
          + ", ".join(f"{n} {status}" for status, n in sorted(_statuses(report).items())) + ")")


def _not_pipelines() -> list[str]:
    """Every fixture the default run takes but the pipelines (`--models pipelines`)."""
    from paracheck.domain.registry import select

    piped = {name for name, _ in select("pipelines")}
    return [name for name, _ in select("all") if name not in piped]


def _print_pipelines(runs: list, without: list) -> None:
    wall = statistics.median(x[0] / y[0] - 1 for x, y in zip(runs, without))
    cpu = statistics.median(x[1] / y[1] - 1 for x, y in zip(runs, without))
    report = runs[0][2]
    piped = [c for c in report["cases"] if c["model"].endswith("-pipeline")]
    own = sum(c.get("seconds") or 0.0 for c in piped)
    print(f"(e) the {len(piped)} pipeline cases add {100 * wall:.0f}% wall, {100 * cpu:.0f}% CPU to the default run "
          f"({statistics.median(s for s, _, _ in without):.1f}s -> {statistics.median(s for s, _, _ in runs):.1f}s); "
          f"their own seconds {own:.1f} of {case_seconds(report):.1f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--skip-per-case", action="store_true", help="leave out (b), the slowest part")
    parser.add_argument("--per-case-sample", type=int, default=None,
                        help="time (b) on this many of the cases and scale up (it is said in the output)")
    parser.add_argument("--extra", default="", help="extra `paracheck run` arguments for (a), space separated")
    parser.add_argument("--keep-report", default=None, help="also write (a)'s JSON report (the first run's) here")
    parser.add_argument("--pipelines", action="store_true", help="also (e): the default run without its pipelines")
    args = parser.parse_args()
    extra = args.extra.split()
    untrained = extra + ["--steps", "0", "--no-checkpoint"]
    runs, plain, bare, floors, without = [], [], [], [], []
    for _ in range(args.repeat):
        runs.append(default_run(args.nproc, extra))
        if args.pipelines:
            without.append(default_run(args.nproc, extra + ["--models", ",".join(_not_pipelines())]))
        plain.append(default_run(args.nproc, untrained))
        bare.append(default_run(args.nproc, untrained, env={"PARACHECK_BARE": "1"}))
        floors.append(floor(args.nproc))
    kit, kit_cpu = statistics.median(s for s, _, _ in runs), statistics.median(c for _, c, _ in runs)
    report = runs[0][2]
    _require_passes(report)
    if args.keep_report:
        with open(args.keep_report, "w") as handle:
            json.dump(report, handle)
    _print_kit(kit, kit_cpu, report)
    c, c_cpu = statistics.median(s for s, _ in floors), statistics.median(u for _, u in floors)
    print(f"(c) floor, {args.nproc} processes importing torch+diffusers+transformers: {c:.1f}s, {c_cpu:.1f} CPU s;  "
          f"kit/c = {_paired(runs, floors):.2f} (wall; goal <= 4), {kit_cpu / c_cpu:.2f} (CPU)")
    p, b = statistics.median(s for s, _, _ in plain), statistics.median(s for s, _, _ in bare)
    over = statistics.median(x[0] / y[0] - 1 for x, y in zip(plain, bare))
    over_cases = statistics.median(case_seconds(x[2]) / case_seconds(y[2]) - 1 for x, y in zip(plain, bare))
    print(f"(b) bare work: {b:.1f}s against the kit's {p:.1f}s without its training passes; overhead "
          f"{100 * over:.0f}% of the whole run, {100 * over_cases:.0f}% of the cases' own seconds (goal <= 25%)")
    added = statistics.median(x[0] / y[0] - 1 for x, y in zip(runs, plain))
    trained = sum(1 for x in report["cases"] if any(k["id"] in ("parity.steps", "checkpoint.roundtrip")
                                                       and k["status"] != "skip" for k in x.get("checks") or []))
    print(f"(d) parity.steps and checkpoint.roundtrip ({trained} cases) add {100 * added:.0f}% to the default run "
          f"({p:.1f}s -> {kit:.1f}s)")
    if without:
        _print_pipelines(runs, without)
    if not args.skip_per_case:
        a, a_cpu, timed_cases, ran = per_case(report, args.nproc, args.per_case_sample)
        how = "" if timed_cases == ran else f" (timed {timed_cases} of {ran} cases, scaled up)"
        print(f"(a) one launch per plain case, fresh interpreters: {a:.1f}s, {a_cpu:.1f} CPU s{how};  "
              f"a/kit = {a / kit:.2f} (wall; goal >= 10), {a_cpu / kit_cpu:.2f} (CPU)")
    print("\nsplit of the kit's run, seconds summed over cases (slowest rank each), wall and CPU:")
    for name, (wall, cpu) in split(kit, report).items():
        print(f"  {name:24} {wall:6.1f}  {'' if cpu is None else f'{cpu:6.1f}'}")
    lines = memory(report)
    if lines:
        print("\nmemory, threads and process groups of the kit's run:")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
