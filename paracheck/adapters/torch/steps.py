"""`parity.steps` for a torch spec: the kit's optimizer loop (`checks.trainloop`) on the parallelized module and on a
fresh single-device copy of the reference module (taken before its backward), held step by step
(`checks.steps.compare_steps`).

Each step's batch is the spec's own `inputs(layout, variant)` asked again under a seed of its own
(`STEP_SEED + step`), so it is the kind of data the spec's model takes. As in the case's training pass, the
reference takes the global batch and each data-parallel rank its shard, with the spec's loss; the loss a step
records on the parallel side is the mean over the ranks of their local losses (`parity.loss`'s rule), and a plan
that sums gradients over the data-parallel ranks (`grad_reduction = "sum"`) is handed each rank's share of the
mean. torch's own parallel APIs do every gradient reduction (FSDP's reduce-scatter, DTensor's TP), so the loop adds
none.
"""

from __future__ import annotations

import torch.distributed as dist

from paracheck.adapters.torch import spec as specs
from paracheck.adapters.torch.batches import call, full, shard, to
from paracheck.adapters.torch import names, steps_localize
from paracheck.checks import trainloop
from paracheck.checks.steps import compare_steps
from paracheck.checks.wholes import wholes
from paracheck.domain.records import CheckId, CheckResult, Status

#: Step `i`'s batch is the spec's inputs under seed STEP_SEED + i.
STEP_SEED = 1000


def not_trained(body) -> str | None:
    """Why this rank cannot take the steps (its training pass's own reasons); None when it can."""
    if not body.case.grads:
        return "--no-grads: no backward, so nothing to step"
    if body.local_loss is None:
        return "the training forward did not run, so nothing to step"
    if body.grads_failed:
        return "parity.grads failed, so every step would start from a wrong gradient (see parity.grads)"
    return None


def batches(body) -> list:
    """Each step's global batch, on this rank's device."""
    return [to(specs.call_inputs(body.case.factory, body.spec, body.layout, body.case.variant, STEP_SEED + step),
                body.device) for step in range(body.case.steps)]


def reference_loss(body, steps: list):
    def loss(model, step: int):
        value = body.loss_fn(call(model, steps[step]), steps[step])
        return value, value
    return loss


def parallel_loss(body, steps: list):
    """This rank's shard's loss to differentiate, and the mean of every rank's (the step's recorded loss)."""
    layout = body.layout
    index, degree = layout.dp_index(body.rank), layout.dp_degree
    share = degree if body.spec.grad_reduction == "sum" else 1

    def loss(model, step: int):
        mine = shard(steps[step], index, degree)
        local = body.loss_fn(call(model, mine), mine)
        mean = full(local).detach().float().clone()
        dist.all_reduce(mean)
        return local / share, mean / layout.world
    return loss


def whole_params(model) -> dict:
    """Every parameter by its name read through wrappers (`names`), whole, detached, on the CPU (a collective
    per mesh and dtype: `checks.wholes`)."""
    return {name: whole.clone() for name, whole in wholes(names.parameters(model)).items()}


def run(body, hooks: trainloop.Hooks = trainloop.PLAIN) -> list[CheckResult]:
    reason = trainloop.agreed(not_trained(body), body.device)
    if reason:
        return [CheckResult(CheckId.STEPS, Status.SKIP, reason)]
    steps = batches(body)
    expected = trainloop.train(body.twin, reference_loss(body, steps), body.case.steps, gather=whole_params)
    actual, raised = body.ctx.attempt(lambda: trainloop.train(body.model, parallel_loss(body, steps), body.case.steps,
                                                              expected.settings, hooks, gather=whole_params),
                                      CheckId.STEPS)
    if raised:
        return [trainloop.raised_result(raised)]
    result = compare_steps(actual.records, expected.records, body.atol, body.rtol)
    result.data.update(trainloop.figures(actual, expected))
    steps_localize.attach(body, result, steps, expected, (reference_loss(body, steps), parallel_loss(body, steps)))
    return [result]
