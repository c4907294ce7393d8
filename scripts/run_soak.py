"""A soak of whole `paracheck run`s, two at a time, under glibc's heap checks (issue 39; docs/ci.md, "The ring crash").

    python3 scripts/run_soak.py OUTDIR [--pairs 10] [--stop-at 22:25] [-- PARACHECK-RUN-ARGS...]

Each pair starts two `paracheck run`s at once (default arguments: the default run, `--timeout 1800` so a starved
case is not reported as a hang) and waits for both before the next pair. Every run gets libc_malloc_debug preloaded
with `MALLOC_CHECK_=3` (`MALLOC_CHECK_` alone checks nothing on glibc >= 2.34), `PYTHONFAULTHANDLER=1`, and
`nice -n 15`; its ranks inherit the environment. Per run, one JSON line in OUTDIR/soak.jsonl: exit code (a negative
one is the signal that ended it), seconds, the report's case counts, the cases that are errors (a rank that died is
one), heap and fatal-signal lines found in its output, and how many of its processes were still alive after it
exited (found by a tag in their environment, then killed), and how many of its processes were seen while it ran and
how many of those lacked the debug library in their maps (`unchecked`: should be 0). At `--stop-at` (UTC, HH:MM) the
runs in flight are killed, recorded as `stopped`, and no pair is started after it.
"""

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time

DEBUG_LIB = "/lib/x86_64-linux-gnu/libc_malloc_debug.so.0"
TAG = "PARACHECK_RUN_SOAK"
# What glibc's checks, a fatal signal under faulthandler, or a dying rank print.
_HEAP = re.compile(r"malloc\(\)|free\(\)|double free|corrupted|tcache|Fatal Python error|Segmentation fault|"
                   r"SIGSEGV|SIGABRT|Aborted|munmap_chunk|malloc_consolidate")


def child_env(tag: str, base: dict | None = None) -> dict:
    """The environment of one soak run: heap checks really on, faulthandler, and the tag its processes carry."""
    env = dict(os.environ if base is None else base)
    env["LD_PRELOAD"] = " ".join(p for p in (DEBUG_LIB, env.get("LD_PRELOAD", "")) if p)
    env.update(MALLOC_CHECK_="3", PYTHONFAULTHANDLER="1", **{TAG: tag})
    return env


def heap_lines(text: str) -> list[str]:
    """The lines of a run's output that speak of heap corruption or a fatal signal."""
    return [line.strip() for line in text.splitlines() if _HEAP.search(line)]


def run_record(name: str, rc: int, seconds: float, output: str, report: dict | None, left: int) -> dict:
    """One run's line in soak.jsonl."""
    cases = (report or {}).get("cases", [])
    return {"run": name, "exit": rc, "signal": signal.Signals(-rc).name if rc < 0 else None,
            "seconds": round(seconds, 1), "summary": (report or {}).get("summary"),
            "errors": [c.get("id") for c in cases if c.get("status") == "error"],
            "heap": heap_lines(output), "left_running": left}


def tagged(tag: str) -> list[int]:
    """Pids of this user's processes whose environment carries the tag."""
    mark = f"{TAG}={tag}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    pids.append(int(entry))
        except (OSError, ValueError):
            continue
    return pids


def sample_checked(tag: str, seen: dict) -> None:
    """Note, in `seen` (pid -> mapped), whether each live process of the run has the debug library mapped: the
    proof that its ranks, not only the run, are checked."""
    for pid in tagged(tag):
        if pid not in seen:
            try:
                with open(f"/proc/{pid}/maps") as f:
                    seen[pid] = os.path.basename(DEBUG_LIB) in f.read()
            except OSError:
                continue


def kill_tagged(tag: str) -> int:
    pids = tagged(tag)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(pids)


def _stop_time(hhmm: str | None, now: datetime.datetime | None = None) -> float:
    """The next HH:MM (UTC) from now: tomorrow's when today's has passed, so a stop after midnight is not already
    past when the soak starts before it."""
    if not hhmm:
        return float("inf")
    now = now or datetime.datetime.now(datetime.timezone.utc)
    h, m = map(int, hhmm.split(":"))
    stop = now.replace(hour=h, minute=m, second=0, microsecond=0)
    if stop <= now:
        stop += datetime.timedelta(days=1)
    return stop.timestamp()


def _start(out: str, name: str, args: list[str]):
    log = open(os.path.join(out, f"{name}.log"), "w")
    cmd = ["nice", "-n", "15", sys.executable, "-m", "paracheck", "run",
           "--report-json", os.path.join(out, f"{name}.json"), *args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=child_env(name), start_new_session=True)
    return proc, log, time.monotonic()


def _finish(out: str, name: str, proc, log, started: float, stopped: bool, seen: dict) -> dict:
    log.close()
    seconds = time.monotonic() - started
    time.sleep(1)  # a rank the run is reaping gets its second
    left = kill_tagged(name)
    path = os.path.join(out, f"{name}.json")
    report = None
    if os.path.exists(path):
        with open(path) as f:
            report = json.load(f)
    with open(os.path.join(out, f"{name}.log"), errors="replace") as f:
        record = run_record(name, proc.returncode, seconds, f.read(), report, left)
    return dict(record, stopped=stopped, processes=len(seen), unchecked=sum(not m for m in seen.values()))


def soak(out: str, pairs: int, stop_at: float, args: list[str]) -> list[dict]:
    os.makedirs(out, exist_ok=True)
    records = []
    for i in range(pairs):
        if time.time() >= stop_at:
            break
        running = [(n, *_start(out, n, args)) for n in (f"pair{i:02d}-a", f"pair{i:02d}-b")]
        stopped, seen = set(), {name: {} for name, *_ in running}
        while any(p.poll() is None for _, p, _, _ in running):
            for name, p, _, _ in running:
                if p.poll() is None:
                    sample_checked(name, seen[name])
            if time.time() >= stop_at:
                for name, p, _, _ in running:
                    if p.poll() is None:
                        stopped.add(name)
                        kill_tagged(name)
                        p.kill()
            time.sleep(2)
        for name, p, log, started in running:
            record = _finish(out, name, p, log, started, name in stopped, seen[name])
            records.append(record)
            with open(os.path.join(out, "soak.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")
            print(json.dumps(record), flush=True)
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--stop-at", help="UTC HH:MM: kill what runs then, start nothing after")
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    ns = parser.parse_args(argv[:cut])
    ns.run_args = argv[cut + 1:]  # paracheck run's own arguments
    if not os.path.exists(DEBUG_LIB):
        raise SystemExit(f"{DEBUG_LIB} not found: the runs would be unchecked")
    records = soak(ns.out, ns.pairs, _stop_time(ns.stop_at), ns.run_args or ["--timeout", "1800"])
    done = [r for r in records if not r["stopped"]]
    pairs_done = len({r["run"][:6] for r in records} - {r["run"][:6] for r in records if r["stopped"]})
    bad = [r for r in done if r["exit"] != 0 or r["heap"] or r["errors"] or r["left_running"] or r["unchecked"]]
    print(f"{pairs_done} pairs completed, {len(done)} runs completed, {len(bad)} not clean, "
          f"{len(records) - len(done)} stopped", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
