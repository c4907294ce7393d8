"""The transformers adapter's localization: every parameter's gradient error, and a failing forward rerun with hooks.

`grads` is the gradient check itself (each parameter's gradient gathered whole with `full_tensor()`, against the
single-process one), which on a failure also carries every parameter's entry and the pattern
(`checks.localize`). `after_checks` runs on every rank after a case's checks: when the logits of either pass
failed on any rank (one all-reduce), both models rerun that pass on this rank's share of the batch with forward
hooks; a DTensor output is taken as this rank's share and put back together over the TP group (or reduced, when
Partial). Pipeline layouts are not localized: each stage holds other modules, so no two stages' traces meet.
"""

from __future__ import annotations


import torch
import torch.distributed as dist

from paracheck.checks import localize
from paracheck.checks.grads import compare_grads
from paracheck.checks.shards import full
from paracheck.domain.records import CheckId, CheckResult, Status
from paracheck.world import meshes

#: A TP-split output of a transformers layer: colwise projections split the last dim, attention's
#: per-head tensors ([batch, heads, seq, dim]) the heads.
TP_DIMS = (-1, 1)


def grads(model, ref_grads: dict, atol, rtol, layout) -> CheckResult:
    """Every parameter's gradient, gathered where sharded, against the single-process one (`checks.grads`).
    A rank may hold no gradient where another holds one (its tokens reached none of an expert pool's weights):
    it joins that gradient's gather with zeros and reports its own gradient missing, so every rank makes the
    same gathers (a gather some ranks skipped would abort the world)."""
    degrees = {"tp": layout.tp, "dp": layout.dp, "fsdp": layout.fsdp, "dpr": layout.dpr, "ep": layout.ep,
               "world": layout.world}
    params = list(model.named_parameters())
    held = _held_anywhere(params) if layout.pp == 1 else [p.grad is not None for _, p in params]
    return compare_grads(((name, _gathered(p, anywhere), ref_grads.get(name)) for (name, p), anywhere in
                          zip(params, held)), atol, rtol, degrees)


def _held_anywhere(params: list) -> list[bool]:
    """Per parameter, whether any rank holds its gradient (one all-reduce; every rank of a layout without
    pipeline stages holds the same parameters, in the same order)."""
    flags = torch.tensor([float(p.grad is not None) for _, p in params])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [bool(f) for f in flags]


def _gathered(param, anywhere: bool):
    """The parameter's gradient gathered whole; None where this rank has none (after taking its part, zeros, in
    a sharded gradient's gather where another rank has one)."""
    if param.grad is not None:
        return full(param.grad)
    if anywhere and hasattr(param, "full_tensor"):
        full(torch.zeros_like(param))
    return None


def after_checks(model, ref, mine: dict, layout, checks: list, result, atol, rtol) -> None:
    """The adapter's hook-in, on every rank after a case's checks: localize a failing logits check."""
    if layout.pp > 1 or not localize.enabled():
        return  # the same on every rank: no collective, no trace
    by_id = {c.id: c for c in checks}
    flags = torch.tensor([float(by_id.get(i) is not None and by_id[i].status == Status.FAIL)
                          for i in (CheckId.FORWARD, CheckId.INFERENCE)])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if not flags.any():
        return
    inputs = {k: v for k, v in mine.items() if k != "labels"}
    for check_id, failed, grad in ((CheckId.FORWARD, flags[0] > 0, True), (CheckId.INFERENCE, flags[1] > 0, False)):
        if not (failed and check_id in by_id):
            continue
        try:
            with torch.no_grad(), localize.Recorder(ref) as recorder:
                ref(**inputs, use_cache=False)
            found = forward(model, inputs, recorder.calls, layout, atol, rtol, grad)
        except Exception as exc:  # a diagnosis that breaks must not turn a failing case into an error
            found = {"error": f"localization raised {type(exc).__name__}: {exc}"}
        by_id[check_id].data.setdefault("localization", {})["forward"] = found


def forward(model, inputs: dict, ref_calls: list, layout, atol, rtol, grad: bool) -> dict:
    with torch.set_grad_enabled(grad), localize.Recorder(model, local=localize.local_share) as recorder:
        model(**inputs, use_cache=False)
    found = localize.forward_localization(recorder.calls, ref_calls, groups(layout), {"<root>"}, atol, rtol,
                                          localize.all_gather_object, dist.get_rank())
    found["pass"] = "training" if grad else "no_grad"
    return found


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
