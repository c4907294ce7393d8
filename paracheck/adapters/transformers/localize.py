"""The transformers adapter's localization: every parameter's gradient error, and a failing forward rerun with hooks.

`grads` is the gradient check itself (each parameter's gradient gathered whole, as `full_tensor()` gives it, against the
single-process one), which on a failure also carries every parameter's entry and the pattern
(`checks.localize`). `after_checks` runs on every rank after a case's checks: when the logits of either pass
failed on any rank (one all-reduce), both models rerun that pass on this rank's share of the batch with forward
hooks; a DTensor output is taken as this rank's share and put back together over the TP group (or reduced, when
Partial). On a pipeline layout each stage compares the modules it holds, and the stages of one pipeline join
their traces (`pipeline_trace`, `checks.stages`).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from paracheck.checks import localize, rerun, stages
from paracheck.checks.grads import compare_grads
from paracheck.checks.wholes import wholes
from paracheck.domain.localization import ForwardLocalization
from paracheck.domain.records import CheckResult
from paracheck.world import meshes

#: A TP-split output of a transformers layer: colwise projections split the last dim, attention's
#: per-head tensors ([batch, heads, seq, dim]) the heads.
TP_DIMS = (-1, 1)


def grads(model, ref_grads: dict, atol, rtol, layout) -> CheckResult:
    """Every parameter's gradient, gathered where sharded (`checks.wholes`: one collective per mesh and dtype),
    against the single-process one (`checks.grads`). A rank may hold no gradient where another holds one (its
    tokens reached none of an expert pool's weights): it joins that gradient's gather with zeros and reports its
    own gradient missing, so every rank makes the same gathers (a gather some ranks skipped would abort the world)."""
    degrees = layout.factor_degrees()
    params = list(model.named_parameters())
    held = _held_anywhere(params) if layout.pp == 1 else [p.grad is not None for _, p in params]
    whole = wholes({name: _joined(p, anywhere) for (name, p), anywhere in zip(params, held)})
    return compare_grads(((name, whole[name] if p.grad is not None else None, ref_grads.get(name))
                          for name, p in params), atol, rtol, degrees)


def _joined(param, anywhere: bool):
    """What this rank brings to the parameter's gradient gather: its gradient; zeros where it has none and another
    rank has a sharded one (so every rank makes the same gathers); None where no gather is needed."""
    if param.grad is not None:
        return param.grad
    return torch.zeros_like(param) if anywhere and hasattr(param, "full_tensor") else None


def _held_anywhere(params: list) -> list[bool]:
    """Per parameter, whether any rank holds its gradient (one all-reduce; every rank of a layout without
    pipeline stages holds the same parameters, in the same order)."""
    flags = torch.tensor([float(p.grad is not None) for _, p in params])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [bool(f) for f in flags]


def after_checks(model, ref, mine: dict, layout, checks: list, result, atol, rtol) -> None:
    """The adapter's hook-in, on every rank after a case's checks: localize a failing logits check."""
    if not localize.enabled():
        return  # the same on every rank: no collective, no trace
    by_id, failed = rerun.failed(checks)
    inputs = {k: v for k, v in mine.items() if k != "labels"}
    ref_calls = None
    for check_id, grad in failed.passes:
        try:
            if ref_calls is None:  # once for both passes: the reference's trace is the same
                ref_calls, _ = rerun.record(ref, lambda m: m(**inputs, use_cache=False))
            found = forward(model, inputs, ref_calls, layout, atol, rtol, grad)
        except Exception as exc:  # a diagnosis that breaks must not turn a failing case into an error
            found = ForwardLocalization(error=rerun.raised(exc))
        rerun.attach(by_id, check_id, found)


def forward(model, inputs: dict, ref_calls: list, layout, atol, rtol, grad: bool) -> ForwardLocalization:
    calls, _ = rerun.record(model, lambda m: m(**inputs, use_cache=False), grad, local=localize.local_share)
    if layout.pp > 1:
        found = pipeline_trace(model, calls, ref_calls, layout, atol, rtol)
        return replace(found, pass_name=rerun.pass_name(grad))
    return rerun.traced(calls, ref_calls, groups(layout), {"<root>"}, atol, rtol, rerun.pass_name(grad))


def pipeline_trace(model, calls: list, ref_calls: list, layout, atol, rtol) -> ForwardLocalization:
    """A pipeline layout's trace (`checks.stages`): this stage's own modules (the layers transformers did not
    replace by a `PipelineIdentityLayer`), joined with the other stages' of this rank's pipeline (the ranks of
    its TP coordinate). The stage is transformers' own (`model._pp_stage`), which computes the logits last."""
    from transformers.distributed.pipeline_parallel import PipelineIdentityLayer

    stage = model._pp_stage
    coords = layout.coords(dist.get_rank())
    pipeline = tuple(sorted((k, v) for k, v in coords.items() if k != "pp"))
    holds = stages.held(model, lambda m: isinstance(m, PipelineIdentityLayer))
    return stages.stage_trace(calls, ref_calls, groups(layout), {"<root>"}, atol, rtol, stage.pp_rank, pipeline,
                              holds, stage.pp_is_last_stage)


def groups(layout) -> list[localize.Group]:
    """The TP group, the one kind of split a non-pipeline layout leaves in a module's output (FSDP and the
    data-parallel replicas hold whole activations of their own share of the batch, which the reference reran)."""
    if layout.tp == 1:
        return []
    partition: dict[tuple, list[int]] = {}
    for rank in range(layout.world):
        coords = layout.coords(rank)
        partition.setdefault(tuple(v for k, v in sorted(coords.items()) if k != "tp"), []).append(rank)
    mine = next(tuple(sorted(g)) for g in partition.values() if dist.get_rank() in g)
    world = meshes.for_world()
    group = world.world if len(mine) == layout.world else world.groups.get(mine)
    return [localize.Group("tp", tuple(tuple(sorted(g)) for g in partition.values()), group, TP_DIMS)]
