"""Run the whole transformers sweep as N shards one after another, each resumable, for the support matrices.

    python3 scripts/sweep_shards.py OUT [--shards N] [--models transformers:all] [-- MORE PARACHECK OPTIONS]

Shard I writes OUT/shardI.json (and its console to OUT/shardI.log); a shard that ended is marked OUT/shardI.done and
skipped on the next call, one that was stopped (Ctrl-C, SIGTERM: its report names what it did not finish) goes on
from its report (`--resume`). Each shard's wall time and the load average it ran at land in OUT/walls.json. Run every
shard from the same commit and transformers: a slice is a function of the case list. Then:

    python3 scripts/support_matrix.py OUT/shard*.json --out docs/support-matrix.md --tasks-out docs/support-matrix-tasks.md
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    previous = signal.signal(signal.SIGTERM, _as_interrupt)  # a SIGTERM to the driver stops its shard as Ctrl-C does
    try:
        for i in range(1, args.shards + 1):
            if os.path.exists(_path(args.out, i, "done")):
                continue
            if _shard(args, i) is None:
                return 130  # stopped: the next call goes on from the shard's report
            open(_path(args.out, i, "done"), "w").close()
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)


def _shard(args, i: int) -> int | None:
    """Shard `i` of the sweep, resumed from its earlier report where one exists; its exit code, None if stopped."""
    report = _path(args.out, i, "json")
    command = [sys.executable, "-m", "paracheck", "run", "--models", args.models, "--shard", f"{i}/{args.shards}",
               "--report-json", report, *args.more]
    if os.path.exists(report):
        shutil.copyfile(report, _earlier(args.out, i))
        command += ["--resume", _earlier(args.out, i)]
    start, load = time.time(), os.getloadavg()[0]
    with open(_path(args.out, i, "log"), "a") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = process.wait()
        except KeyboardInterrupt:  # the run writes its report on SIGTERM; wait for it
            process.send_signal(signal.SIGTERM)
            process.wait()
            return None
    _note(args.out, i, time.time() - start, load, os.getloadavg()[0], code)
    return None if _interrupted(report) else code


def _as_interrupt(signum, frame):
    raise KeyboardInterrupt


def _interrupted(report: str) -> bool:
    try:
        with open(report) as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return True  # no report written: nothing to call finished
    return bool(data.get("not_run")) or any(e.get("kind") == "interrupted" for e in data.get("events", []))


def _note(out: str, i: int, seconds: float, load_before: float, load_after: float, code: int) -> None:
    path = os.path.join(out, "walls.json")
    walls = []
    if os.path.exists(path):
        with open(path) as handle:
            walls = json.load(handle)
    walls.append({"shard": i, "seconds": round(seconds, 1), "load": [round(load_before, 1), round(load_after, 1)],
                  "exit_code": code, "ended": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    with open(path, "w") as handle:
        json.dump(walls, handle, indent=1)


def _path(out: str, i: int, suffix: str) -> str:
    return os.path.join(out, f"shard{i}.{suffix}")


def _earlier(out: str, i: int) -> str:
    """Where a stopped shard's report is kept while the shard resumes from it: a name `OUT/shard*.json` does not
    match, so the matrices never merge it after the resumed report (whose cases it would overwrite: a case it holds
    as an error is run again, and the earlier error would win)."""
    return _path(out, i, "json.earlier")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the folder for the shards' reports, logs and wall times")
    parser.add_argument("--shards", type=int, default=6, help="how many shards (default 6)")
    parser.add_argument("--models", default="transformers:all", help="the sweep (default transformers:all)")
    parser.add_argument("more", nargs="*", help="more `paracheck run` options, after --")
    return parser


if __name__ == "__main__":
    sys.exit(main())
