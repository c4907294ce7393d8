"""The launcher: one world of ranks runs many cases; a broken world is replaced for the cases left.

Ranks are plain subprocesses in their own session (so a kill reaches everything they started),
meeting through a FileStore in a private run directory, so concurrent runs share no port or file.
A case that hangs past the timeout gets every rank's Python stack dumped (faulthandler on SIGUSR1)
before the world is killed; the cases after it run in a fresh world.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from .case import Case
from .worker import WORLD_BROKEN, write_json

_PEER_LOST = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|ECONNRESET|"
                        r"Socket Timeout|failed to recv|Read error", re.I)
_POLL = 0.2
_GRACE = 10.0


@dataclass
class RunEvent:
    """Something that broke the run itself: a hang, a signal, a world that would not start."""
    kind: str  # hang | signal | start
    index: int | None
    message: str


@dataclass
class Outcome:
    results: dict[int, list[dict]] = field(default_factory=dict)
    events: list[RunEvent] = field(default_factory=list)
    worlds: int = 0


class Launcher:
    def __init__(self, backend, nproc: int, timeout: float, startup_timeout: float = 300.0, keep: bool = False):
        self.backend, self.nproc, self.timeout = backend, nproc, timeout
        self.startup_timeout, self.keep = startup_timeout, keep
        self.procs: list[subprocess.Popen] = []
        self.rundir: str | None = None

    # -- public ------------------------------------------------------------------------------
    def run(self, cases: list[Case]) -> Outcome:
        self.rundir = tempfile.mkdtemp(prefix="paracheck-")
        os.makedirs(os.path.join(self.rundir, "results"))
        write_json(os.path.join(self.rundir, "run.json"),
                   {"backend": self.backend.name, "timeout": self.timeout, "cases": [c.to_json() for c in cases]})
        outcome = Outcome()
        remaining = list(range(len(cases)))
        try:
            while remaining:
                outcome.worlds += 1
                state = self._world(outcome.worlds, remaining)
                self._collect(remaining, outcome)
                done = [i for i in remaining if i in outcome.results]
                remaining = [i for i in remaining if i not in outcome.results]
                if state["kind"] == "done" and remaining:
                    state = dict(state, kind="crash")  # every rank exited 0, yet cases lack results
                if not remaining:
                    break
                current = self._current(remaining)
                if current is None and done:
                    continue  # the world stopped between cases: nothing to blame, start another
                if current is None:
                    outcome.events.append(RunEvent("start", None, self._start_failure(state)))
                    for index in remaining:
                        outcome.results[index] = self._synthetic(index, "the ranks could not start")
                    break
                index = current
                outcome.results[index] = self._broken_case(index, state, outcome)
                remaining.remove(index)
        finally:
            self.stop()
            if not self.keep:
                shutil.rmtree(self.rundir, ignore_errors=True)
        return outcome

    def stop(self) -> None:
        """Kill every rank's whole process group; safe to call twice."""
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.procs = []

    # -- one world ---------------------------------------------------------------------------
    def _world(self, attempt: int, todo: list[int]) -> dict:
        for rank in range(self.nproc):
            for name in (f"progress.{rank}.json", f"stacks.{rank}.txt"):
                path = os.path.join(self.rundir, name)
                if os.path.exists(path):
                    os.remove(path)
        write_json(os.path.join(self.rundir, f"todo.{attempt}.json"), todo)
        self.procs = [self._spawn(rank, attempt) for rank in range(self.nproc)]
        return self._supervise(attempt)

    def _spawn(self, rank: int, attempt: int) -> subprocess.Popen:
        env = dict(os.environ)
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(self.nproc), LOCAL_WORLD_SIZE=str(self.nproc),
                   PARACHECK_STORE=os.path.join(self.rundir, f"store.{attempt}"),
                   PARACHECK_TODO=f"todo.{attempt}.json", PYTHONUNBUFFERED="1")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        if self.backend.name == "gloo":
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        log = open(os.path.join(self.rundir, f"log.{attempt}.{rank}.txt"), "w")
        try:
            return subprocess.Popen([sys.executable, "-m", "paracheck.worker", self.rundir], env=env,
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        finally:
            log.close()

    def _supervise(self, attempt: int) -> dict:
        started = time.time()
        while True:
            codes = [p.poll() for p in self.procs]
            if all(c is not None for c in codes):
                return {"kind": "done" if all(c == 0 for c in codes) else "crash", "codes": codes, "attempt": attempt}
            if any(c not in (None, 0) for c in codes):
                codes = self._wait_all(_GRACE)
                self.stop()
                return {"kind": "crash", "codes": codes, "attempt": attempt}
            progress = self._progress()
            running = [p for p in progress.values() if p.get("index") is not None]
            if running:
                oldest = min(p["started"] for p in running)
                if time.time() - oldest > self.timeout:
                    return self._hang(attempt, progress)
            elif not progress and time.time() - started > self.startup_timeout:
                self.stop()
                return {"kind": "start-timeout", "codes": codes, "attempt": attempt}
            time.sleep(_POLL)

    def _wait_all(self, grace: float) -> list:
        deadline = time.time() + grace
        while time.time() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(_POLL)
        return [p.poll() for p in self.procs]

    def _hang(self, attempt: int, progress: dict) -> dict:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    proc.send_signal(signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        time.sleep(2.0)  # faulthandler writes from a C signal handler; give it a moment
        stacks = {}
        for rank in range(self.nproc):
            path = os.path.join(self.rundir, f"stacks.{rank}.txt")
            stacks[rank] = open(path).read() if os.path.exists(path) else ""
        codes = [p.poll() for p in self.procs]
        self.stop()
        return {"kind": "hang", "codes": codes, "attempt": attempt, "stacks": stacks, "progress": progress}

    # -- reading back --------------------------------------------------------------------------
    def _progress(self) -> dict[int, dict]:
        found = {}
        for rank in range(self.nproc):
            path = os.path.join(self.rundir, f"progress.{rank}.json")
            try:
                with open(path) as handle:
                    found[rank] = json.load(handle)
            except (OSError, ValueError):
                continue
        return found

    def _current(self, remaining: list[int]) -> int | None:
        indices = [p.get("index") for p in self._progress().values()]
        live = [i for i in indices if i is not None and i in remaining]
        return min(live) if live else None

    def _collect(self, remaining: list[int], outcome: Outcome) -> None:
        for index in remaining:
            ranks = []
            for rank in range(self.nproc):
                path = os.path.join(self.rundir, "results", f"{index}.{rank}.json")
                try:
                    with open(path) as handle:
                        ranks.append(json.load(handle))
                except (OSError, ValueError):
                    break
            if len(ranks) == self.nproc:
                outcome.results[index] = ranks

    def _log_tail(self, attempt: int, rank: int, lines: int = 25) -> str:
        path = os.path.join(self.rundir, f"log.{attempt}.{rank}.txt")
        try:
            with open(path, errors="replace") as handle:
                text = [l for l in handle.read().splitlines() if "Warning" not in l and l.strip()]
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def _synthetic(self, index: int, reason: str) -> list[dict]:
        return [{"index": index, "rank": r, "status": "error", "reason": reason, "checks": [], "findings": []}
                for r in range(self.nproc)]

    def _start_failure(self, state: dict) -> str:
        tails = [f"rank {r}: {self._log_tail(state['attempt'], r, 8)}" for r in range(self.nproc)]
        if state["kind"] == "start-timeout":
            return f"no rank started a case within {self.startup_timeout:.0f}s\n" + "\n".join(tails)
        return f"the ranks exited before running a case (exit codes {state['codes']})\n" + "\n".join(tails)

    def _broken_case(self, index: int, state: dict, outcome: Outcome) -> list[dict]:
        """Per-rank results for the case that was running when its world broke."""
        attempt = state["attempt"]
        written = {}
        for rank in range(self.nproc):
            path = os.path.join(self.rundir, "results", f"{index}.{rank}.json")
            if os.path.exists(path):
                with open(path) as handle:
                    written[rank] = json.load(handle)
        if state["kind"] == "hang":
            return self._hung_case(index, state, written, outcome)
        ranks = []
        for rank, code in enumerate(state["codes"]):
            if rank in written:
                ranks.append(written[rank])
                continue
            tail = self._log_tail(attempt, rank)
            if code is not None and code < 0:
                reason = f"rank {rank} died by signal {signal.Signals(-code).name}"
                outcome.events.append(RunEvent("signal", index, reason))
            elif code is None:
                reason = f"rank {rank} was stopped after a peer failed"
            elif code == WORLD_BROKEN:
                reason = f"rank {rank} stopped with its world broken"
            else:
                reason = f"rank {rank} exited with code {code}"
            ranks.append({"index": index, "rank": rank, "status": "error", "reason": reason, "traceback": tail,
                          "checks": [], "findings": []})
        for entry in ranks:
            entry["secondary"] = bool(_PEER_LOST.search(entry.get("traceback", "") + entry.get("reason", ""))) or \
                entry["reason"].endswith("after a peer failed")
        return ranks

    def _hung_case(self, index: int, state: dict, written: dict, outcome: Outcome) -> list[dict]:
        stuck = [r for r in range(self.nproc) if r not in written]
        where = {r: _innermost(state["stacks"].get(r, "")) for r in stuck}
        odd = _odd_ones_out(where)
        message = (f"case {index} hung past --timeout {self.timeout:g}s; stuck ranks {stuck}: "
                   + "; ".join(f"rank {r} in {w}" for r, w in where.items()))
        if odd:
            message += f"; likely cause: rank{'s' if len(odd) > 1 else ''} {odd}, stuck where the others are not"
        outcome.events.append(RunEvent("hang", index, message))
        ranks = []
        for rank in range(self.nproc):
            if rank in written:
                ranks.append(written[rank])
            else:
                ranks.append({"index": index, "rank": rank, "status": "error",
                              "reason": f"hung past --timeout {self.timeout:g}s in {where[rank]}",
                              "stacks": state["stacks"].get(rank, ""), "checks": [], "findings": [],
                              "hung": True, "secondary": bool(odd) and rank not in odd})
        return ranks


def _odd_ones_out(where: dict[int, str]) -> list[int]:
    """Ranks stuck at a frame fewer ranks share than the most common one: usually the ranks that
    entered a collective the others never reached (or skipped one they are waiting in)."""
    counts: dict[str, int] = {}
    for frame in where.values():
        counts[frame] = counts.get(frame, 0) + 1
    if len(counts) < 2:
        return []
    most = max(counts.values())
    return sorted(r for r, frame in where.items() if counts[frame] < most)


def _innermost(stack: str) -> str:
    """Where a rank sits in a faulthandler dump: its innermost frame, and the innermost outside torch."""
    blocks = stack.split("\n\n")
    main = next((b for b in blocks if "Current thread" in b), blocks[0] if blocks else "")
    frames = re.findall(r'File "(.+)", line (\d+) in (\S+)', main)
    if not frames:
        return "an unknown frame (no stack was captured)"

    def fmt(frame):
        return f"{os.path.basename(frame[0])}:{frame[1]} in {frame[2]}"

    outside = next((f for f in frames if f"{os.sep}torch{os.sep}" not in f[0] and "<frozen" not in f[0]), None)
    if outside is None or outside == frames[0]:
        return fmt(frames[0])
    return f"{fmt(frames[0])}, called from {fmt(outside)}"
