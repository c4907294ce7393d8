"""A local world (`paracheck run --local-world N`): every rank of an N-rank world in this one process.

The launcher starts one process instead of N; it runs each case of its todo through the same skeleton as a rank
(`skeleton.run_passes`), with `InLocalWorld` as the way: the parallel passes run once for every rank under torch's
`LocalTensorMode` (`world.localworld`), the library's code that is not the same on every rank runs per rank
(`world.regions`, named by the adapter's `local_scope`), and every check runs once per rank, acting as that rank.
It writes one `RankResult` per rank and case, as N ranks would, so merging, `failed_ranks`, known failures and the
report work unchanged.

What a local world cannot run is a skip, in its words (`records.LOCAL_WORLD_SKIP`): Python whose value differs
between ranks outside a per-rank region, an operation `LocalTensorMode` has no rule for. Localization's reruns and
the optional passes (generate, steps, checkpoint) are not taken here; their checks say so.
"""

from __future__ import annotations

import dataclasses
import os
import time

from paracheck.domain import registry
from paracheck.domain.records import LOCAL_WORLD_SKIP, Failure, FailureKind, RankResult, RankStatus
from paracheck.launch.protocol import Phase, RankExit, RankProgress, RunDir, write_json
from paracheck.rank.skeleton import run_passes, settle
from paracheck.world.site import CaseSite

LATER_OFF = "a local world (--local-world) takes no localization rerun, generation, steps or checkpoint"


class InLocalWorld:
    """The skeleton's way in a local world: SPMD passes under the world's `LocalTensorMode`, checks per rank."""

    localizes = False
    later_off = LATER_OFF

    def __init__(self, world):
        self.world = world

    def spmd(self):
        return self.world.mode

    def each(self, checks) -> dict:
        from paracheck.world.regions import each_rank

        return {rank: list(found) for rank, found in each_rank(lambda rank: checks(), self.world.ranks,
                                                               carry_modes=False).items()}


def run_local_case(index: int, case, backend, world, refs_dir: str, workdir: str) -> list[RankResult]:
    """One case for every rank of `world`: one `RankResult` per rank."""
    off = _control_off(case)
    if off:
        return [RankResult(index, rank, RankStatus.SKIP, reason=off, failure=Failure(FailureKind.SKIP))
                for rank in world.ranks]
    adapter = registry.adapter(case.library)
    known = adapter.local_limit(case)
    if known:  # the adapter knows before any parallel code that one process cannot run it as every rank
        if not (isinstance(known, tuple) and len(known) == 3 and all(isinstance(p, str) for p in known)):
            raise TypeError(f"adapter {case.library!r}: local_limit(case) must return None or (exception, site, why), "
                            f"three strings; it returned {known!r}")
        exception, where, why = known
        return [RankResult(index, rank, RankStatus.SKIP, reason=f"{LOCAL_WORLD_SKIP}: {why}",
                           failure=Failure(FailureKind.SKIP, None, exception, where)) for rank in world.ranks]
    os.makedirs(workdir, exist_ok=True)
    site = CaseSite(index, workdir, refs_dir, lambda key: True)
    with adapter.local_scope():
        result, checks, raised = run_passes(case, backend, site, InLocalWorld(world))
    results = []
    for rank in world.ranks:
        mine = dataclasses.replace(result, rank=rank, timings=dict(result.timings))
        settle(mine, checks.get(rank, []), raised, case)
        results.append(mine)
    limits = [(str(r), r.failure) for r in raised if one_process_limit(r.failure)]
    if result.status == RankStatus.ERROR and one_process_limit(result.failure):
        limits.append((result.reason, result.failure))
    if limits:
        why, typed = limits[0]
        reason = f"{LOCAL_WORLD_SKIP}: {why}"
        failure = Failure(FailureKind.SKIP, typed.check, typed.exception, typed.site)
        for mine in results:
            mine.status, mine.reason, mine.failure, mine.checks = RankStatus.SKIP, reason, failure, []
    return results


def _control_off(case) -> str | None:
    """Why a control cannot be judged here, before any local-world limit: first its own refusal of the layout (what
    a gloo world says, not that one process left it out); then a bug that shows only in passes a local world does
    not take (the steps, a save, generation), so every check it must trip would pass unrun; None when it can."""
    if not case.control:
        return None
    control = registry.get_control(case.control)
    if own := control.skip_reason(case.layout):
        return own
    if control.shows_in_training or control.shows_in_generate:
        return f"{case.control} shows only in {', '.join(c.value for c in control.must_trip)}: {LATER_OFF}"
    return None


def one_process_limit(failure: Failure | None) -> bool:
    """Whether a failure is the local world's limit, not the case's: Python that needed one value of a per-rank one
    (`RankDependent`), or an operation `LocalTensorMode` has no rule for."""
    from paracheck.world.localworld import limit

    return failure is not None and limit(failure.exception)


def run_local_world(rundir: RunDir, todo, backend, size: int, measure) -> int:
    """The cases `todo` yields as (index, case), each for every rank of one local world of `size` ranks;
    `measure(result)` fills the process's memory and CPU after each (the worker's, as for a rank)."""
    from paracheck.world.localworld import LocalWorld

    with LocalWorld(size) as world:
        for index, case in todo:
            write_json(rundir.progress(0), RankProgress(Phase.STARTED, time.time(), index).to_json())
            results = run_local_case(index, case, backend, world, rundir.refs_dir, rundir.case_dir(index))
            measure(results[0])
            for result in results:
                for name in ("peak_rss_mb", "rss_mb", "cpu_seconds", "threads", "process_groups"):
                    setattr(result, name, getattr(results[0], name))
                write_json(rundir.result(index, result.rank), result.to_json())
    write_json(rundir.progress(0), RankProgress(Phase.DONE, time.time()).to_json())
    return RankExit.DONE
