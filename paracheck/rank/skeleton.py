"""One case on one rank, for every adapter: the passes in order, the tolerance, the timings, a raise typed and blamed.

The adapter supplies the passes (`domain.adapter.CaseBody`); this module owns everything the passes share, so no
adapter can drift from another: the tolerance comes from the case's dtype and this rank's device, with the case's
own overrides honoured (0.0 included); a dtype the adapter does not run is refused by name; inference runs before
training, training before the backward; a raise after collectives began may be a peer's fault, and says so.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
import traceback

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from paracheck.checks.compare import tolerance
from paracheck.domain import registry
from paracheck.domain.adapter import CASE_BODY, CaseContext, Refused, Tolerance
from paracheck.domain.records import CheckId, CheckResult, Failure, FailureKind, Raised, RankResult, RankStatus, Status
from paracheck.launch.attribution import lost_peer
from paracheck.rank import declared
from paracheck.world import meshes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: The passes a raise is named by (a case's reason reads "forward: RuntimeError: ..."), and the check a raise in
#: each fails: the one that pass feeds (a parallelize that raised left no parallel structure to check). The
#: reference raising is the spec's own model failing on one device: no check of the parallel model fails.
PASS_CHECKS = {"reference": None, "parallelize": CheckId.MESH, "inference": CheckId.INFERENCE,
               "forward": CheckId.FORWARD, "backward": CheckId.GRADS, "generate": CheckId.GENERATE,
               "steps": CheckId.STEPS, "checkpoint": CheckId.CHECKPOINT}
#: The pass a check's step belongs to (`ctx.attempt`'s raises, named in the case's reason).
PASS_OF = {check: name for name, check in PASS_CHECKS.items() if check is not None}
#: What a pass may raise that is the case's failure, not the rank's end: every Exception, and DCP's
#: CheckpointException, which derives from BaseException only (uncaught, it would end the rank).
RAISES = (Exception, CheckpointException)


def case_tolerance(case, device_type: str) -> Tolerance:
    """(atol, rtol) for the case's dtype on `device_type`, each replaced by the case's own where it sets one."""
    atol, rtol = tolerance(DTYPES[case.dtype], device_type)
    return Tolerance(atol if case.atol is None else case.atol, rtol if case.rtol is None else case.rtol)


def run_case(case, backend, site) -> RankResult:
    """The case's passes through its adapter's `case_body`; never raises. Afterwards the case's objects are
    collected and every process group no mesh holds is destroyed (`Meshes.settle`)."""
    result, checks, raised = run_passes(case, backend, site, OnThisRank(dist.get_rank()))
    settle(result, checks.get(result.rank, []), raised, case)
    return result


def run_passes(case, backend, site, way) -> tuple[RankResult, dict, list]:
    """The case's passes, where `way` runs them (`OnThisRank`, or every rank of a local world): the result they
    filled, each rank's checks `{rank: [CheckResult]}` and what the passes raised. Never raises."""
    started = time.time()
    result = RankResult(site.index, dist.get_rank(), RankStatus.OK)
    meshes.for_world()  # first, so a new world drops what the last one kept before any pass reads it (`world.recent`)
    groups = meshes.group_names()
    raised: list[Raised] = []
    checks: dict = {}
    at = At()
    ctx = CaseContext(case, backend, site, result, case_tolerance(case, backend.device_type),
                      lambda name: Phase(result, name), lambda step, check_id: _attempt(step, check_id, result, raised))
    try:
        adapter = registry.adapter(case.library)
        if case.dtype not in adapter.dtypes:
            raise Refused(f"--dtype {case.dtype}: the {case.library} adapter runs {', '.join(adapter.dtypes)} only")
        if case.control and (off := _pass_off(case)):
            raise Refused(off)
        with adapter.case_body(ctx) as body:
            _passes(CASE_BODY.bind(body, case.library), ctx, raised, way, checks, at)
        result.raised_in_parallel = bool(raised)
    except Refused as exc:
        result.status, result.reason, result.failure = exc.status, str(exc), exc.failure
        result.raised_in_parallel = False
    except RAISES as exc:
        _raised_in(result, at, exc, checks)
    # A rank whose collective broke because a peer went away did not cause the failure: it says so, and the
    # launcher blames the peer.
    result.secondary = result.raised_in_parallel and lost_peer(result.traceback + result.reason)
    del ctx
    gc.collect()  # the case's model first (its hooks make cycles): a group it still held would outlive destruction
    meshes.for_world().settle(groups)
    result.seconds = round(time.time() - started, 3)
    return result, checks, raised


class OnThisRank:
    """Where a rank of a real world runs a case: every pass and every check here, for this rank alone."""

    localizes = True
    #: The optional passes this way cannot take, and why (none).
    later_off: str | None = None

    def __init__(self, rank: int):
        self.rank = rank

    def spmd(self):
        return contextlib.nullcontext()

    def each(self, checks) -> dict:
        """`{rank: checks()}` for every rank this way runs."""
        return {self.rank: list(checks())}


def bare() -> bool:
    """`PARACHECK_BARE=1` (benchmarks/bench.py's bare work): the passes' model calls alone, the reference, the
    parallel model, its forwards and backward, with no check, comparison or localization; the cases report no
    checks. Every rank of a world inherits one environment, so all decide alike."""
    return os.environ.get("PARACHECK_BARE") == "1"


class At:
    """The pass a case is in now: what a raise is reported as."""
    now = "reference"


def _raised_in(result: RankResult, at: At, exc: BaseException, checks: dict) -> None:
    """A pass raised: the case is an error naming the pass, and that pass's check fails with the raise (typed where
    it happened, so explore names the bug by exception and frame, not by the rank's exit); the checks made before
    it are kept."""
    check = PASS_CHECKS.get(at.now)
    result.status, result.reason = RankStatus.ERROR, f"{at.now}: {type(exc).__name__}: {exc}"
    result.traceback, result.failure = traceback.format_exc(), Failure.raised(exc, check)
    result.checks = checks.get(result.rank, []) + ([CheckResult(
        check, Status.FAIL, f"{at.now} raised {type(exc).__name__}: {exc}", failure=result.failure)] if check else [])


def _passes(body, ctx: CaseContext, raised: list, way, checks: dict, at: At) -> None:
    """The order every adapter's case runs in (see `domain.adapter`): the passes where `way` runs its world's SPMD
    code, the checks once per rank it answers for (`checks` gathers them by rank); `at` names the pass running."""
    result, phase, checking = ctx.result, ctx.phase, not bare()

    def check(name: str, run) -> None:
        at.now = name
        with phase("checks"):
            for rank, found in way.each(run).items():
                checks.setdefault(rank, []).extend(found)

    def spmd(name: str, step) -> None:
        at.now = name
        with phase("parallel"), way.spmd():
            step()

    with phase("reference"):
        body.reference()
    result.raised_in_parallel = True  # from here on a raise may leave peers inside a collective
    spmd("parallelize", body.parallelize)
    if checking:
        check("structure checks", body.structure_checks)
    # Inference first, as a pipeline calls the model; the training forward's graph is the backward's.
    spmd("inference", body.inference)
    spmd("forward", body.training)
    if checking:
        check("forward checks", body.forward_checks)
    if body.backward_skip() is None:
        spmd("backward", body.backward)
    if not checking:
        result.raised_in_parallel = False
        return
    check("gradient checks", body.grads_checks)
    # On every rank, which decide alike whether a failing pass is rerun with hooks (not where declared known failures
    # explain it whole: `rank.declared`); a rank whose pass raised does not join (its peers may be inside another
    # collective of that pass, and the fail-fast rule ends the world).
    mine = checks.setdefault(result.rank, [])
    if body.provides("localize") and not raised and way.localizes:
        at.now = "localize"
        with phase("localize"):
            if (reasons := declared.explained(ctx.case, result, mine)) is None:
                body.localize(mine)
            else:
                declared.not_rerun(mine, reasons)
    # Generation changes nothing in the model, the steps and the save do: last, as localization reruns the passes
    # above on the model as they were checked. A rank whose pass raised takes none of them, as it takes no
    # localization: its peers may still be inside that pass.
    for run, name, check_id, asked in ((body.generate, "generate", CheckId.GENERATE, ctx.case.generate),
                                       (body.steps, "steps", CheckId.STEPS, ctx.case.steps > 0),
                                       (body.checkpoint, "checkpoint", CheckId.CHECKPOINT, ctx.case.checkpoint)):
        at.now = name
        later = _later(run, ctx, name, check_id, asked, raised, way.later_off)
        for found in checks.values() if way.later_off else [mine]:
            found.extend(later)
    result.raised_in_parallel = False


def _later(run, ctx: CaseContext, name: str, check_id: CheckId, asked: bool, raised: list, off: str | None) -> list:
    """The optional `generate`, `steps` or `checkpoint` pass (`run`) where the case asks for it (a body without
    one answers with the contract's default: a skip that says so), unless the way cannot take it (`off`)."""
    if not asked:
        return []
    if off:
        return [CheckResult(check_id, Status.SKIP, f"not run: {off}")]
    if raised:
        return [CheckResult(check_id, Status.SKIP, f"not run: an earlier pass raised on this rank ({raised[0]})")]
    with ctx.phase(name):
        return list(run())


def _pass_off(case) -> str | None:
    """Why a control cannot be judged here, decided alike on every rank before any collective (a skip, not a miss):
    it must trip parity.steps, parity.generate or checkpoint.roundtrip, and the case does not take that pass (`--steps 0`,
    `--no-checkpoint`, a dtype whose steps are not held to a rule)."""
    must = set(registry.get_control(case.control).must_trip)
    if CheckId.STEPS in must and not case.steps:
        return (f"{case.control} shows in parity.steps only, which this run takes no step of (--steps 0; a mixin's "
                "paracheck_steps = 0)")
    if CheckId.STEPS in must and case.dtype != "fp32":  # the steps are held to the fp32 rule; a planted 1e-3 is
        return f"{case.control} shows in parity.steps only, which a {case.dtype} case does not take"  # within bf16's
    if CheckId.GENERATE in must and not case.generate:
        return (f"{case.control} shows in parity.generate only, which this case does not take (the default tier "
                "generates on one layout of each kind; --all on every one)")
    if CheckId.CHECKPOINT in must and not case.checkpoint:
        return (f"{case.control} shows in checkpoint.roundtrip only, which this run does not take (--no-checkpoint; a "
                "mixin's paracheck_checkpoint = False)")
    return None


def settle(result: RankResult, checks: list, raised: list[Raised], case) -> None:
    """After the passes, a rank's result takes its checks; where the passes ran to their end the first failing check
    types the case's failure, and a pass that raised makes the case an error (a control may raise once its bug is
    planted: its checks still decide detection)."""
    if result.status != RankStatus.OK:
        return
    result.checks = checks
    failing = next((c for c in result.checks if c.status == Status.FAIL), None)
    result.failure = failing and (failing.failure or Failure(FailureKind.CHECK, failing.id))
    if raised and not case.control:
        named = PASS_OF.get(raised[0].failure.check)
        result.status, result.reason = RankStatus.ERROR, f"{named}: {raised[0]}" if named else str(raised[0])


def _attempt(step, check_id: CheckId, result: RankResult, raised: list):
    """One step of the parallel model: (its value, None), or (None, Raised) typed as a failure of `check_id`, with
    this rank's traceback kept (the first raise is the case's reason)."""
    try:
        return step(), None
    except RAISES as exc:
        result.traceback = result.traceback or traceback.format_exc()
        error = Raised(f"{type(exc).__name__}: {exc}", Failure.raised(exc, check_id))
        raised.append(error)
        return None, error


class Phase:
    """Adds the wall and CPU seconds spent inside each `with` to `result.timings[name]` and `[name_cpu]`
    (re-enterable). CPU seconds are what a machine shared with other jobs does not blur."""

    def __init__(self, result: RankResult, name: str):
        self.result, self.name = result, name

    def __enter__(self):
        self.started, self.cpu = time.perf_counter(), time.process_time()

    def __exit__(self, *exc):
        add_time(self.result, self.name, time.perf_counter() - self.started, time.process_time() - self.cpu)


def add_time(result: RankResult, name: str, wall: float, cpu: float) -> None:
    for key, spent in ((name, wall), (f"{name}_cpu", cpu)):
        result.timings[key] = round(result.timings.get(key, 0.0) + spent, 4)
