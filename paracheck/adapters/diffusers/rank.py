"""The diffusers adapter's rank side: one case on one rank, from its plan to its checked `RankResult`.

The generic rank loop (`rank.worker`) hands each diffusers case to `run_case`. Planning is identical on every
rank (`plan`); the single-device reference is computed by the rank that owns its key (`reference`); then the
case's model is copied from the reference's weights, parallelized by its route, and run twice, as users run
it: under `torch.no_grad()` (inference), then with gradients (training and the backward), every check
judging this rank only.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from paracheck.adapters.diffusers import attention, library, localize, reference
from paracheck.adapters.diffusers.checks import STRUCTURE, CheckContext, grads_skip_reason, run_checks
from paracheck.adapters.diffusers.fitting import Unfittable
from paracheck.adapters.diffusers.plan import Plan, Sources, plan
from paracheck.adapters.diffusers.routes import apply
from paracheck.adapters.diffusers.weights import copy_of
from paracheck.checks.collectives import count_collectives
from paracheck.checks.compare import tolerance
from paracheck.adapters import get_control
from paracheck.domain.case import Case
from paracheck.domain.records import CheckId, Failure, FailureKind, Raised, RankResult, RankStatus, Status
from paracheck.launch.attribution import lost_peer
from paracheck.world import meshes
from paracheck.world.site import CaseSite, local_device


@dataclass
class _Kept:
    """What a rank keeps between cases: the model sources it loaded, and the reference it read last."""
    sources: Sources = field(default_factory=Sources)
    last_reference: reference.LastReference = field(default_factory=reference.LastReference)


#: This process's sources and last reference: a rank runs one world at a time, so one of each is enough.
_KEPT = _Kept()


def run_case(case: Case, backend, site: CaseSite) -> RankResult:
    """The adapter's entry (`adapters.rank_entry("diffusers")`): plan the case, compute its reference where
    this rank owns its key, run it, and destroy any process group a mesh does not hold."""
    p = plan(case, backend, _KEPT.sources)
    wall, cpu = time.perf_counter(), time.process_time()
    if p.key and site.computes(p.key) and not reference.exists(p, site.refs_dir):
        reference.compute(p, site.refs_dir, local_device(backend))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    groups = meshes.group_names()
    result = run_planned(site.index, p, backend, site.workdir, site.refs_dir, _KEPT.last_reference)
    meshes.for_world().settle(groups)
    _add_time(result, "reference", wall, cpu)
    return result


def run_planned(index: int, p: Plan, backend, workdir: str, refs_dir: str,
                last: reference.LastReference | None = None) -> RankResult:
    """Run a planned case on this rank: read its reference, parallelize, run the checks."""
    started = time.time()
    result = RankResult(index, dist.get_rank(), RankStatus.OK, route=p.route, fit=p.fit,
                        model_class=p.model_class.__name__ if p.model_class else None, attention_backend=p.attention,
                        inputs=p.traits)
    if p.stop:  # decided while planning, identically on every rank
        result.status, result.reason, result.failure = p.stop.status, p.stop.reason, p.stop.failure
        return result
    try:
        with _phase(result, "reference"):
            ref = (last or reference.LastReference()).get(p, refs_dir, local_device(backend))
        _run_parallel(p, ref, backend, workdir, result)
    except Unfittable as exc:
        result.status, result.reason, result.failure = RankStatus.SKIP, str(exc), exc.failure
    except Exception as exc:
        result.status, result.reason = RankStatus.ERROR, f"{type(exc).__name__}: {exc}"
        result.traceback, result.failure = traceback.format_exc(), Failure.raised(exc)
    # A rank whose collective broke because a peer went away did not cause the failure: it says so.
    result.secondary = result.raised_in_parallel and lost_peer(result.traceback + result.reason)
    result.seconds = round(time.time() - started, 3)
    return result


def _run_parallel(p: Plan, ref: reference.Reference, backend, workdir: str, result: RankResult) -> None:
    case = p.case
    control = get_control(case.control) if case.control else None
    atol, rtol = tolerance(ref.out.dtype, backend.device_type)
    parallel, checking = _phase(result, "parallel"), _phase(result, "checks")
    fault = control.attention_fault if control else None
    with library.Findings() as findings, attention.scope(p.attention, fault), \
            library.parallel_shims(backend.device_type):
        with parallel:
            model = copy_of(p.model_class, p.init_dict, ref.model.state_dict(), ref.out.device, ref.out.dtype)
            result.raised_in_parallel = True  # from here on, a raise may leave peers inside a collective
            model, applied = apply(p.route, model, case.layout, backend, control, ref.model, workdir, case.cp_options)
        ctx = CheckContext(model, ref.model, applied, ref.out, ref.weights,
                           atol if case.atol is None else case.atol, rtol if case.rtol is None else case.rtol,
                           grads_requested=case.grads, ref_out32=ref.out32, ref_grads32=ref.grads32, inputs=ref.inputs)
        with checking:
            checks = run_checks(STRUCTURE, ctx)
        # Inference first, as a pipeline calls the model; then the training pass, whose graph the backward needs.
        with parallel, torch.no_grad(), count_collectives(result.rank) as ctx.inference_collectives:
            ctx.inference_out, ctx.inference_error = _attempt(lambda: reference.forward(model, ref.inputs), result,
                                                              CheckId.INFERENCE)
        with parallel, count_collectives(result.rank) as ctx.collectives:
            ctx.out, ctx.forward_error = _attempt(lambda: reference.forward(model, ref.inputs), result, CheckId.FORWARD)
        with checking:
            checks += run_checks([CheckId.COLLECTIVES, CheckId.FORWARD, CheckId.INFERENCE], ctx)
        if grads_skip_reason(ctx) is None:
            with parallel:
                _, ctx.backward_error = _attempt(lambda: (ctx.out * ref.weights).sum().backward(), result,
                                                 CheckId.GRADS)
        with checking:
            checks += run_checks([CheckId.GRADS], ctx)
        localize.after_checks(ctx, ref.inputs, checks, result)  # issue 29: a failing pass rerun with hooks
    raised = ctx.inference_error or ctx.forward_error or ctx.backward_error
    result.raised_in_parallel = bool(raised)
    result.findings = findings.messages
    result.checks = checks
    failing = next((c for c in checks if c.status == Status.FAIL), None)
    result.failure = failing and (failing.failure or Failure(FailureKind.CHECK, failing.id))
    if raised and not case.control:
        # A control may raise once its bug is planted; its checks still decide detection.
        result.status, result.reason = RankStatus.ERROR, str(raised)


class _phase:
    """Adds the wall and CPU seconds spent inside each `with` to `result.timings[name]` and
    `[name_cpu]` (re-enterable). CPU seconds are what a machine shared with other jobs does not blur."""

    def __init__(self, result: RankResult, name: str):
        self.result, self.name = result, name

    def __enter__(self):
        self.started, self.cpu = time.perf_counter(), time.process_time()

    def __exit__(self, *exc):
        _add_time(self.result, self.name, time.perf_counter() - self.started, time.process_time() - self.cpu)


def _add_time(result: RankResult, name: str, wall: float, cpu: float) -> None:
    for key, spent in ((name, wall), (f"{name}_cpu", cpu)):
        result.timings[key] = round(result.timings.get(key, 0.0) + spent, 4)


def _attempt(step, result: RankResult, check_id: CheckId):
    """Run one step of the parallel model; a raise becomes a failed check `check_id`, with this rank's
    traceback and the raise's identity."""
    try:
        return step(), None
    except Exception as exc:
        # The first raise is the case's reason (the inference pass runs first): keep its traceback with it.
        result.traceback = result.traceback or traceback.format_exc()
        return None, Raised(f"{type(exc).__name__}: {exc}", Failure.raised(exc, check_id))
