"""Interim per-case loop for the torch adapter: drives its `CaseBody` in the order `domain.adapter` documents,
until the kit's own skeleton (`rank.skeleton.run_case`) runs every adapter's body.

Builds the `RankResult`, the tolerance (dtype and device, with the case's overrides), times each phase, turns
`Refused` into a skip in its words and any other raise into an error typed with `Failure.raised` (its reason
names the pass that raised: "parallelize: ..."), and frees the groups no mesh holds.
"""

from __future__ import annotations

import gc
import time
import traceback

import torch
import torch.distributed as dist

from paracheck.adapters.torch.body import case_body
from paracheck.checks.compare import tolerance
from paracheck.domain.adapter import CaseContext, Refused, Tolerance
from paracheck.domain.records import CheckId, CheckResult, Failure, RankResult, RankStatus, Raised, Status
from paracheck.launch.attribution import lost_peer
from paracheck.world import meshes
from paracheck.world.site import local_device

#: Pass -> the phase its time counts under.
_PHASES = {"reference": "reference", "parallelize": "parallel", "inference": "parallel", "training": "parallel",
           "forward_checks": "checks", "backward": "parallel", "grads_checks": "checks"}


def run_case(case, backend, site) -> RankResult:
    """The torch adapter's rank-side entry point (`site`: a `world.site.CaseSite`); never raises."""
    started = time.time()
    result = RankResult(site.index, dist.get_rank(), RankStatus.OK)
    groups = meshes.group_names()
    step = "reference"
    try:
        for step in _drive(_context(case, backend, site, result), result):
            pass
    except Refused as exc:
        result.status, result.reason, result.raised_in_parallel = exc.status, str(exc), False
        result.failure = exc.failure
    except Exception as exc:
        result.status, result.reason = RankStatus.ERROR, f"{step}: {type(exc).__name__}: {exc}"
        result.traceback, result.failure = traceback.format_exc(), Failure.raised(exc, _STEP_CHECK.get(step))
        result.secondary = lost_peer(result.traceback + result.reason)
    gc.collect()  # the case's model first: a group it still held would outlive destruction
    meshes.for_world().settle(groups)
    result.seconds = round(time.time() - started, 3)
    return result


_STEP_CHECK = {"parallelize": CheckId.MESH, "inference": CheckId.INFERENCE, "training": CheckId.FORWARD,
               "backward": CheckId.GRADS}


def _drive(ctx: CaseContext, result: RankResult):
    """Run the body's passes, yielding each pass's name before it runs (the caller names the one that raised)."""
    with case_body(ctx) as body:
        yield "reference"
        with ctx.phase("reference"):
            body.reference()
        result.raised_in_parallel = True  # from here a raise may leave peers inside a collective
        yield "parallelize"
        with ctx.phase("parallel"):
            result.checks += body.parallelize()
        for name in ("inference", "training"):
            yield name
            with ctx.phase("parallel"):
                getattr(body, name)()
        yield "forward_checks"
        with ctx.phase("checks"):
            result.checks += body.forward_checks()
        skip = body.backward_skip()
        if skip:
            result.checks.append(CheckResult(CheckId.GRADS, Status.SKIP, skip))
        else:
            yield "backward"
            with ctx.phase("parallel"):
                body.backward()
            yield "grads_checks"
            with ctx.phase("checks"):
                result.checks += body.grads_checks()
        result.raised_in_parallel = False


def _context(case, backend, site, result: RankResult) -> CaseContext:
    atol, rtol = tolerance(torch.float32, local_device(backend).type)
    return CaseContext(case, backend, site, result, Tolerance(case.atol or atol, case.rtol or rtol),
                       phase=lambda name: _Phase(result, name), attempt=_attempt)


def _attempt(step, check_id):
    try:
        return step(), None
    except Exception as exc:
        return None, Raised(f"{type(exc).__name__}: {exc}", Failure.raised(exc, check_id))


class _Phase:
    """Adds the wall and CPU seconds inside the `with` to `result.timings[name]` and `[name_cpu]`."""

    def __init__(self, result: RankResult, name: str):
        self.result, self.name = result, name

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def __exit__(self, *exc):
        for key, spent in ((self.name, time.perf_counter() - self.wall),
                           (f"{self.name}_cpu", time.process_time() - self.cpu)):
            self.result.timings[key] = round(self.result.timings.get(key, 0.0) + spent, 4)
