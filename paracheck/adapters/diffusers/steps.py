"""`parity.steps` for a diffusers model: the kit's optimizer loop (`checks.trainloop`) on the parallel model and on
a fresh single-device copy of the reference's weights, held step by step (`checks.steps.compare_steps`).

diffusers has no trainer, so the loop is the kit's: torch's AdamW (weight decay on) and gradient clipping at a max
norm that clips. Each step takes fresh inputs, drawn from the case's own (every floating `*hidden_states` input
redrawn under a per-step seed; ids, timesteps and masks kept), and a squared error (the
output, gathered under CP, against a fixed target), the same on every rank.

diffusers leaves two gradient reductions to its user, and the loop does them as a user must (`user_reductions`):
under CP each rank's gradients cover its slice of the sequence, so they are summed over the CP group; under TP a
parameter outside the `_tp_plan` that acts on the local heads (a QK norm after the head split) has a partial
gradient on each TP rank, summed over the TP group where the TP ranks' copies differ (`parity.grads` reads them so).

The reference run is never the cached reference model (`reference.LastReference` keeps that for the next case):
a copy of its weights steps, and its trace is kept for the next case of the same reference and steps (a control
after its plain case). Every rank runs it alike, so no rank waits on another for it.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from paracheck.adapters.diffusers import library
from paracheck.adapters.diffusers.checks import all_gather_pieces, cp_process_group, grads_skip_reason
from paracheck.adapters.diffusers.reference import forward
from paracheck.adapters.diffusers.weights import copy_of
from paracheck.checks import trainloop
from paracheck.checks.buckets import gather_each, reduce_each
from paracheck.checks.shards import assemble, full
from paracheck.checks.steps import compare_steps
from paracheck.domain.records import CheckId, CheckResult, Status
from paracheck.world.recent import Recent

#: Step `i`'s inputs are drawn under seed STEP_SEED + i.
STEP_SEED = 1000

#: (reference key, steps) -> the reference run's trace: one kept, as `reference.LastReference` keeps one reference.
_KEPT = Recent(1, "diffusers steps trace")


def fresh_inputs(inputs: dict, step: int) -> dict:
    """The case's inputs with every floating `*hidden_states` tensor redrawn (same shape, dtype, device) under seed
    `STEP_SEED + step`: the data a training step sees anew, the ids, timesteps and masks that shape it kept."""
    generator = torch.Generator().manual_seed(STEP_SEED + step)
    out = dict(inputs)
    for name in sorted(inputs):
        value = inputs[name]
        if name.endswith("hidden_states") and isinstance(value, torch.Tensor) and value.is_floating_point():
            out[name] = torch.randn(value.shape, generator=generator).to(value.device, value.dtype)
    return out


def step_loss(inputs: dict, target: torch.Tensor):
    """The loss of step `step`: the squared error of the output on that step's fresh inputs to `target` (the
    reference's loss weights, a fixed draw of the output's shape), summed. Bounded below, so the steps descend
    rather than run off as the weighted sum `parity.grads` differentiates would."""
    def loss(model, step: int):
        value = (forward(model, fresh_inputs(inputs, step)) - target).pow(2).sum()
        return value, value
    return loss


def not_trained(body) -> str | None:
    """Why this rank cannot take the steps (the training pass's own reasons); None when it can."""
    if body.case.dtype != "fp32":
        return (f"--dtype {body.case.dtype}: parity.steps holds the steps to the fp32 elementwise rule, and a "
                f"{body.case.dtype} run has no fp32 twin of its steps here")
    checks = body.checks
    reason = grads_skip_reason(checks)
    if reason:
        return f"no backward ({reason}), so nothing to step"
    if checks.backward_error:
        return f"the backward raised {checks.backward_error}, so nothing to step"
    if body.grads_failed:
        return "parity.grads failed, so every step would start from a wrong gradient (see parity.grads)"
    return None


def run(body, hooks: trainloop.Hooks = trainloop.PLAIN) -> list[CheckResult]:
    reason = trainloop.agreed(not_trained(body), body.ref.out.device)
    if reason:
        return [CheckResult(CheckId.STEPS, Status.SKIP, reason)]
    ref, steps = body.ref, body.case.steps
    loss = step_loss(ref.inputs, ref.weights)
    expected = reference_trace(body, loss)
    summed: set = set()
    applied = body.checks.applied
    specs = library.tp_shard_specs(ref.model, applied.layout.tp) if applied.layout.has_tp else {}
    actual, raised = body.ctx.attempt(lambda: trainloop.train(
        body.model, loss, steps, expected.settings, hooks,
        after_backward=functools.partial(user_reductions, applied=applied, summed=summed),
        gather=functools.partial(whole_params, specs=specs, applied=applied)), CheckId.STEPS)
    if raised:
        return [trainloop.raised_result(raised)]
    tol = body.ctx.tolerance
    result = compare_steps(actual.records, expected.records, tol.atol, tol.rtol)
    result.data.update(trainloop.figures(actual, expected))
    result.data["user_reductions"] = reductions_said(body.checks.applied.layout, sorted(summed))
    return [result]


def reference_trace(body, loss) -> trainloop.Trace:
    """The loop on a fresh single-device copy of the reference's weights (kept for the next case that shares it)."""
    def trace():
        ref = body.ref
        twin = copy_of(body.plan.model_class, body.plan.init_dict, ref.model.state_dict(), ref.out.device,
                       ref.out.dtype)
        return trainloop.train(twin, loss, body.case.steps)
    return _KEPT.get((body.plan.key, body.case.steps), trace)


def whole_params(model, specs: dict, applied) -> dict:
    """Every parameter whole, on the CPU: a planned one from its TP shards by the plan's own blocks (`assemble`; a
    DTensor's `full_tensor` would join a fused projection's blocked shards end to end), one all-gather per dtype."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    sharded = {n: p.to_local() for n, p in params.items() if hasattr(p, "to_local") and specs[n].dim is not None}
    whole = {n: full(p) for n, p in params.items() if n not in sharded}
    if sharded:
        gather = functools.partial(all_gather_pieces, group=applied.meshes["tp"].get_group())
        whole.update({n: assemble(pieces, specs[n]) for n, pieces in gather_each(sharded, gather).items()})
    return {n: whole[n].cpu().clone() for n in params}


def user_reductions(model, applied, summed: set) -> None:
    """After each backward, what diffusers leaves to its user (see the module docstring): TP-partial gradients of
    plain parameters summed over the TP group, then every gradient summed over the CP group. One collective per
    group and dtype, as `parity.grads` moves them."""
    layout = applied.layout
    grads = {n: p.grad for n, p in sorted(model.named_parameters()) if p.grad is not None}
    if layout.has_tp:
        plain = {n: g for n, g in grads.items() if not hasattr(g, "to_local")}
        gather = functools.partial(all_gather_pieces, group=applied.meshes["tp"].get_group())
        with torch.no_grad():
            for name, pieces in gather_each(plain, gather).items():
                if any(not torch.equal(piece, pieces[0]) for piece in pieces[1:]):
                    grads[name].copy_(torch.stack(pieces).sum(0))
                    summed.add(name)
    if layout.has_cp:
        group = cp_process_group(applied)
        local = {n: (g.to_local() if hasattr(g, "to_local") else g) for n, g in grads.items()}
        with torch.no_grad():
            for name, whole in reduce_each(local, lambda flat: dist.all_reduce(flat, group=group)).items():
                local[name].copy_(whole)


def reductions_said(layout, summed: list[str]) -> list[str]:
    """The reductions the loop did for the user, in words, for the report."""
    said = []
    if layout.has_cp:
        said.append("every gradient summed over the CP group (diffusers leaves it to the user: each rank's covers "
                    "its slice of the sequence)")
    if summed:
        said.append(f"{len(summed)} TP-partial gradients of parameters outside the _tp_plan summed over the TP group "
                    f"(e.g. {summed[0]})")
    return said
