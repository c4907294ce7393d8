"""A torch spec's pipeline: its stages and schedule (`torch.distributed.pipelining`), driven by the kit.

On a layout with `pp`, the kit hands the spec's `pipeline(model, mesh, layout, loss_fn)` a deep copy of the
reference and a loss of an output and a target (the spec's loss, or the kit's default, of the output and the batch
the target stands for); it returns this rank's `PipelineStage`s (one, or several for an interleaved schedule) and
a schedule built on them with that loss (GPipe, 1F1B, interleaved 1F1B, ...). The kit then drives the schedule:
`eval` for the no_grad pass, `step` for the training pass (its forward and backward over the microbatches), each
on this rank's data-parallel shard of the batch, given to the first stage as its input and to the last as the
loss's target. The last stage's output and the mean of its microbatch losses are broadcast over the stage group,
so every rank holds them to the reference's as any layout's ranks do; every parameter of this rank's stages is
held to the reference's gradient by name (a stage is a copy of the model with the layers it does not hold
removed, torchtitan's way, so its parameters keep the model's names), and a reference parameter no rank's stage
holds is named as that.

The batch is one tensor (or a dict of one): it is the first stage's input and the loss's target alike, and the
schedule splits both into microbatches on dim 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from paracheck.adapters.torch import names
from paracheck.domain.adapter import Refused


class Pipeline:
    """This rank's stages and the schedule that runs them."""

    def __init__(self, stages, schedule, key: str | None):
        self.stages = list(stages) if isinstance(stages, (list, tuple)) else [stages]
        self.schedule, self.key = schedule, key

    @property
    def parts(self) -> list:
        return [stage.submod for stage in self.stages]

    @property
    def first(self) -> bool:
        return any(stage.is_first for stage in self.stages)

    @property
    def last(self) -> bool:
        return any(stage.is_last for stage in self.stages)

    def parameters(self) -> dict:
        """Every parameter of this rank's stages by its clean name (`names`)."""
        out: dict = {}
        for part in self.parts:
            for name, param in names.parameters(part).items():
                out.setdefault(name, param)
        return out


def one_tensor(batch) -> tuple[str | None, torch.Tensor]:
    """(its key, or None for a tensor batch; the tensor): a pipeline's batch is one tensor."""
    if isinstance(batch, torch.Tensor):
        return None, batch
    tensors = [(k, v) for k, v in batch.items() if isinstance(v, torch.Tensor)]
    if len(tensors) != 1 or len(batch) != 1:
        raise Refused(f"a pipeline case takes a batch of one tensor (its first stage's input and its loss's target), "
                      f"got {sorted(batch)}")
    return tensors[0]


def build(body) -> Pipeline:
    """The spec's stages and schedule for this rank, with the kit's loss (scaled as the body's backward is)."""
    key, _ = one_tensor(body.mine)
    share = body.layout.dp_degree if body.spec.grad_reduction == "sum" else 1

    def loss_fn(output, target):
        return body.loss_fn(output, target if key is None else {key: target}) / share

    made = body.spec.pipeline(body.copy, body.mesh, body.layout, loss_fn)
    if not (isinstance(made, tuple) and len(made) == 2 and hasattr(made[1], "step")):
        raise TypeError(f"the spec's pipeline(model, mesh, layout, loss_fn) must return (stages, schedule), got "
                        f"{type(made).__name__}")
    return Pipeline(made[0], made[1], key)


def run(pipe: Pipeline, body, train: bool):
    """One pass of the schedule on this rank's shard: (the last stage's output, the mean of its microbatch losses
    or None without training), on every rank of the stage group."""
    _, batch = one_tensor(body.mine)
    args = (batch,) if pipe.first else ()
    target = batch if pipe.last else None
    losses = [] if pipe.last else None
    if train:
        output = pipe.schedule.step(*args, target=target, losses=losses)
    else:
        with torch.no_grad():
            output = pipe.schedule.eval(*args, target=target, losses=losses)
    share = body.layout.dp_degree if body.spec.grad_reduction == "sum" else 1
    loss = torch.stack([l.detach() for l in losses]).mean() * share if losses else None
    return from_last(body, output, loss)


def from_last(body, output, loss):
    """The last stage's output and loss, broadcast over this rank's stage group (on the CPU, detached)."""
    group = body.mesh.get_group("pp")
    last = dist.get_global_rank(group, body.layout.pp - 1)
    held = [None if output is None else _cpu(output), None if loss is None else loss.detach().cpu()]
    dist.broadcast_object_list(held, src=last, group=group)
    device = body.device
    output = _to(held[0], device)
    return output, (None if held[1] is None else held[1].to(device))


def elsewhere(params: dict) -> set:
    """The names every rank's stages hold, together (one all_gather_object over the world)."""
    held = [None] * dist.get_world_size()
    dist.all_gather_object(held, sorted(params))
    return set().union(*map(set, held))


def _cpu(value):
    from paracheck.adapters.torch.batches import each_tensor, full

    return each_tensor(full(value), lambda t: t.detach().cpu())


def _to(value, device):
    from paracheck.adapters.torch.batches import each_tensor

    return each_tensor(value, lambda t: t.to(device))
