"""The launcher: run every case in as few worlds as possible; a broken world is replaced for the rest.

It owns the run directory and the loop over worlds. Starting and stopping ranks is the `supervisor`'s
job, blaming ranks for a broken case is `attribution`'s; this module reads the results the ranks
wrote (`RankResult` from JSON, the only place it is parsed) and hands each finished case to `on_case`
as soon as every rank has written it. Torch-free.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from paracheck.launch.attribution import attribute
from paracheck.domain.case import Case
from paracheck.launch.protocol import (FAIL_FAST_GRACE, EndKind, Phase, RankProgress, RunDir, Todo, read_json,
                                       run_switches, write_json)
from paracheck.domain.records import RankResult, RankStatus, RunEvent
from paracheck.launch.supervisor import Supervisor


@dataclass
class Outcome:
    results: dict[int, list[RankResult]] = field(default_factory=dict)
    events: list[RunEvent] = field(default_factory=list)
    worlds: int = 0
    start_method: str = ""
    references: int = 0
    #: Seconds from starting each world until its first rank began a case, summed over worlds.
    start_seconds: float = 0.0


#: What `after_hang` may say: "skip" the cases that would meet a hang again, or "run" them anyway.
AFTER_HANG = ("skip", "run")


class Launcher:
    def __init__(self, backend, nproc: int, timeout: float, startup_timeout: float = 300.0, keep: bool = False,
                 on_case: Callable[[int, list[RankResult]], None] | None = None, after_hang: str = "skip",
                 known: list[dict] = (), switches: dict | None = None, local_world: bool = False):
        if after_hang not in AFTER_HANG:
            raise ValueError(f"after_hang {after_hang!r}: must be one of {', '.join(AFTER_HANG)}")
        self.backend, self.nproc, self.timeout = backend, nproc, timeout
        self.startup_timeout, self.keep, self.on_case = startup_timeout, keep, on_case
        self.after_hang = after_hang
        #: The run's declared known failures, as plain data: a rank does not rerun a failure they explain whole
        #: with localization's hooks (`rank.declared`).
        self.known = list(known)
        #: Run switches over the environment's (`protocol.RUN_SWITCHES`), for a caller that is not a command.
        self.switches = dict(run_switches(), **(switches or {}))
        self.supervisor: Supervisor | None = None
        self.cases: list[Case] = []
        #: One process runs every rank of the world (`rank.localrun`), writing a result per rank.
        self.local_world = local_world

    def run(self, cases: list[Case]) -> Outcome:
        self.cases = cases
        rundir = RunDir(tempfile.mkdtemp(prefix="paracheck-")).make()
        write_json(rundir.run, {"backend": self.backend.name, "timeout": self.timeout, "switches": self.switches,
                                "known": self.known, "cases": [c.to_json() for c in cases],
                                "local_world": self.nproc if self.local_world else None})
        self.supervisor = Supervisor(rundir, self.backend.name, 1 if self.local_world else self.nproc, self.timeout,
                                     self.startup_timeout)
        outcome = Outcome(start_method=self.supervisor.method)
        try:
            self._loop(rundir, list(range(len(cases))), outcome)
            outcome.references = len([n for n in os.listdir(rundir.refs_dir) if n.endswith(".safetensors")])
        finally:
            self.stop()
            if not self.keep:
                shutil.rmtree(rundir.path, ignore_errors=True)
        return outcome

    def _loop(self, rundir: RunDir, remaining: list[int], outcome: Outcome) -> None:
        while remaining:
            before = len(remaining)
            outcome.worlds += 1
            clock = _StartClock()  # before start: forking waits for the fork server's imports
            self.supervisor.start(outcome.worlds, Todo(tuple(remaining)))
            end = self.supervisor.watch(outcome.worlds, tick=lambda: (clock.tick(self.supervisor),
                                                                      self._collect(rundir, remaining, outcome)))
            outcome.start_seconds += clock.seconds
            self._collect(rundir, remaining, outcome)
            if not remaining:
                return
            current = _current(end.progress, remaining)
            if current is None and end.kind == EndKind.DONE:
                current = remaining[0]  # every rank exited 0, yet this case has no results: blame it
            if current is None and end.kind != EndKind.START and len(remaining) < before:
                continue  # the world stopped between cases: nothing to blame, start another
            if current is None:
                self._could_not_start(end, remaining, outcome)
                return
            written = {r: res for r in range(self.nproc) if (res := _read_result(rundir, current, r)) is not None}
            ranks, events = attribute(current, end, written, self.timeout)
            if self.local_world:  # the one process stood for every rank: each is what it was
                ranks = [replace(ranks[0], rank=r) for r in range(self.nproc)]
            outcome.events.extend(events)
            self._finish(current, ranks, remaining, outcome)
            if end.kind == EndKind.HANG and self.after_hang == "skip":
                self._skip_after_hang(current, remaining, outcome)

    def _skip_after_hang(self, hung: int, remaining: list[int], outcome: Outcome) -> None:
        """A hang costs one timeout: the cases left that would meet it again are reported, not run."""
        case = self.cases[hung]
        reason = (f"not run: {case.id} hung past --timeout {self.timeout:g}s on this model and layout "
                  "(--after-hang run runs it)")
        for index in meets_hang_again([self.cases[i] for i in remaining], case, remaining):
            self._finish(index, [RankResult(index, r, RankStatus.SKIP, reason=reason) for r in range(self.nproc)],
                         remaining, outcome)

    def _collect(self, rundir: RunDir, remaining: list[int], outcome: Outcome) -> None:
        # Every rank writes its results in the order of `remaining` (its todo), so no case after the first
        # one a rank has not written can be complete: stop there. Trying every case's files at each poll
        # cost the launcher most of a core on a run of 2000 cases, taken from the ranks.
        for index in list(remaining):
            ranks = []
            for rank in range(self.nproc):
                ranks.append(_read_result(rundir, index, rank))
                if ranks[-1] is None:
                    return
            self._finish(index, ranks, remaining, outcome)

    def _finish(self, index: int, ranks: list[RankResult], remaining: list[int], outcome: Outcome) -> None:
        outcome.results[index] = ranks
        remaining.remove(index)
        if self.on_case:
            self.on_case(index, ranks)

    def _could_not_start(self, end, remaining: list[int], outcome: Outcome) -> None:
        tails = "\n".join(f"rank {r}: {t}" for r, t in sorted(end.logs.items()))
        if end.kind == EndKind.START:
            message = f"no rank started a case within {self.startup_timeout:.0f}s\n{tails}"
        else:
            message = f"the ranks exited before running a case (exit codes {end.codes})\n{tails}"
        outcome.events.append(RunEvent("start", None, message))
        for index in list(remaining):
            self._finish(index, [RankResult(index, r, RankStatus.ERROR, reason="the ranks could not start")
                                 for r in range(self.nproc)], remaining, outcome)

    def stop(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()


class Feeder:
    """One world kept up while cases are fed to it one at a time (`paracheck explore`), each answered
    before the next is chosen; a world that breaks is replaced at the next case. Use as a context manager."""

    #: Seconds the ranks get to leave cleanly once told to stop.
    STOP_GRACE = 30.0

    def __init__(self, backend, nproc: int, timeout: float, startup_timeout: float = 300.0, keep: bool = False):
        self.backend, self.nproc, self.timeout = backend, nproc, timeout
        self.startup_timeout, self.keep = startup_timeout, keep
        self.worlds, self.next, self.live = 0, 0, False

    def __enter__(self) -> "Feeder":
        self.rundir = RunDir(tempfile.mkdtemp(prefix="paracheck-explore-")).make()
        write_json(self.rundir.run, {"backend": self.backend.name, "timeout": self.timeout, "switches": run_switches(),
                                     "cases": []})
        self.supervisor = Supervisor(self.rundir, self.backend.name, self.nproc, self.timeout, self.startup_timeout)
        return self

    def run(self, case: Case) -> tuple[list[RankResult], list[RunEvent]]:
        """Every rank's result for `case`, and what broke the world if it broke."""
        index, self.next = self.next, self.next + 1
        write_json(self.rundir.feed(index), case.to_json())
        if not self.live:
            self.worlds += 1
            self.supervisor.start(self.worlds, Todo(feed_from=index))
            self.live = True
        end = self.supervisor.watch(self.worlds, until=lambda: self._written(index) == self.nproc)
        results = [_read_result(self.rundir, index, r) for r in range(self.nproc)]
        if end is None:
            self._settle(results)
            return results, []
        self.live = False
        self.supervisor.stop()
        written = {r: res for r, res in enumerate(results) if res is not None}
        if len(written) == self.nproc:
            return results, []
        if end.kind == EndKind.START or not written and not end.progress:
            message = "the ranks could not start\n" + "\n".join(f"rank {r}: {t}" for r, t in sorted(end.logs.items()))
            return [RankResult(index, r, RankStatus.ERROR, reason="the ranks could not start")
                    for r in range(self.nproc)], [RunEvent("start", index, message)]
        return attribute(index, end, written, self.timeout)

    def _written(self, index: int) -> int:
        return sum(os.path.exists(self.rundir.result(index, r)) for r in range(self.nproc))

    def _settle(self, results: list[RankResult]) -> None:
        """After a case that raised mid-collectives the ranks decide whether their world is intact: wait
        until every rank waits for the next case, or replace the world if one left."""
        if not any(r.raised_in_parallel for r in results):
            return
        deadline = time.time() + FAIL_FAST_GRACE + 5.0
        while time.time() < deadline and not self.supervisor.exited():
            progress = self.supervisor.progress()
            if len(progress) == self.nproc and all(p.phase is Phase.WAITING for p in progress.values()):
                return
            time.sleep(0.05)
        self.live = False
        self.supervisor.stop()

    def __exit__(self, exc_type, *exc) -> None:
        with open(self.rundir.stop, "w"):
            pass
        if self.live and exc_type is None:
            deadline = time.time() + self.STOP_GRACE
            self.supervisor.watch(self.worlds, until=lambda: time.time() > deadline)
        self.supervisor.stop()
        if not self.keep:
            shutil.rmtree(self.rundir.path, ignore_errors=True)


class _StartClock:
    """How long a world took to start its first case (the cost of starting ranks)."""

    def __init__(self):
        self.started, self.seconds = time.time(), 0.0

    def tick(self, supervisor) -> None:
        if not self.seconds and supervisor.progress():
            self.seconds = time.time() - self.started


def meets_hang_again(cases: list[Case], hung: Case, indices: list[int]) -> list[int]:
    """The indices (of `cases`, named by `indices`) of the cases on the hung case's model and layout: the
    same model code over the same mesh, so the same stuck collective is the likely end."""
    return [i for i, c in zip(indices, cases)
            if (c.library, c.model, c.factory, c.layout.name) == (hung.library, hung.model, hung.factory, hung.layout.name)]


def _current(progress: dict[int, RankProgress], remaining: list[int]) -> int | None:
    live = [p.index for p in progress.values() if p.running and p.index in remaining]
    return min(live) if live else None


def _read_result(rundir: RunDir, index: int, rank: int) -> RankResult | None:
    data = read_json(rundir.result(index, rank))
    return RankResult.from_json(data) if data is not None else None
