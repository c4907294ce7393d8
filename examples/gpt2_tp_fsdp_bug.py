"""The plans of `gpt2_tp_fsdp.py` with one planted bug each, as a user writing them from scratch might:

`spec_bias`: the MLP's down projection is the user's own row-parallel linear (Megatron's), which adds its bias on
every TP rank before the partial products are summed, so the bias counts tp times. GPT-2 starts its biases at
zero, so the forward, the loss and every gradient are exact: only training shows it, once a step has moved the
bias. parity.steps fails at step 2 and its localization names `h.0.mlp.c_proj`, where step 2's forward first
leaves the reference.
`spec_loss_gathered`: the head's logits gathered whole (a Replicate DTensor), then handed to torch's
vocabulary-parallel cross-entropy (`loss_parallel`) as if each rank held its vocabulary shard: every rank's
softmax runs over tp copies of the vocabulary, so the loss is off by log(tp) (0.69 on tp2). The outputs are
exact; parity.loss and parity.grads fail.

    paracheck run --spec examples/gpt2_tp_fsdp_bug.py:spec_bias --nproc 4 --layouts tp2xfsdp2         # steps fail
    paracheck run --spec examples/gpt2_tp_fsdp_bug.py:spec_loss_gathered --nproc 2 --layouts tp2      # loss fails
"""

from __future__ import annotations

import os
import sys

import torch.nn.functional as F
from torch import nn

from paracheck.adapters.torch.spec import Spec

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # gpt2_tp_fsdp.py beside this file, by its name
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (compile imports a checkpointed block's module)
import gpt2_tp_fsdp as gpt2  # noqa: E402


class RowParallelLinear(nn.Module):
    """A user's own row-parallel linear: the weight split on its input dimension (a DTensor, Shard(1)), each TP
    rank's partial product reduce-scattered onto the sequence. The bug: the bias is added to each partial
    product, before the sum, instead of once after it."""

    def __init__(self, linear: nn.Linear, mesh):
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        super().__init__()
        self.mesh = mesh
        self.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), mesh, [Shard(1)]))
        self.bias = nn.Parameter(distribute_tensor(linear.bias.detach(), mesh, [Replicate()]))

    def forward(self, x):
        from torch.distributed.tensor import DTensor, Partial, Shard

        partial = F.linear(x, self.weight.to_local(), self.bias.to_local())  # the bias on every rank
        return DTensor.from_local(partial, self.mesh, [Partial()]).redistribute(self.mesh, [Shard(1)]).to_local()


def bias_every_rank_plan() -> dict:
    plan = gpt2.block_plan()
    del plan["mlp.c_proj"]  # parallelized by the user's own module below
    return plan


def parallelize_bias(model, mesh, layout):
    if layout.tp > 1:
        gpt2.apply_tp(model, mesh["tp"], bias_every_rank_plan)
        for block in model.h.values():
            block.mlp.c_proj = RowParallelLinear(block.mlp.c_proj, mesh["tp"])
    if layout.dp_dims:
        gpt2.apply_fsdp(model, mesh[layout.dp_dims])
    return model


def gathered_head() -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    plan = gpt2.model_plan()
    # The logits gathered whole, kept a DTensor (Replicate) for the loss.
    plan["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=False)
    return plan


def parallelize_gathered(model, mesh, layout):
    gpt2.apply_tp(model, mesh["tp"], top=gathered_head)
    if layout.dp_dims:
        gpt2.apply_fsdp(model, mesh[layout.dp_dims])
    return model


def loss_on_gathered(logits, batch):
    """The bug: each rank's whole logits declared its vocabulary shard (Shard(-1)) for the parallel loss."""
    from torch.distributed.tensor import DTensor, Shard

    as_shard = DTensor.from_local(logits.to_local(), logits.device_mesh, [Shard(-1)])
    return gpt2.cross_entropy(as_shard, batch)


def reference_loss(logits, batch):
    return gpt2.cross_entropy(logits, batch) if not hasattr(logits, "device_mesh") else loss_on_gathered(logits, batch)


LAYOUTS = ("tp2", "tp4", "tp2xfsdp2")
spec_bias = Spec(gpt2.build, parallelize_bias, gpt2.inputs, supports=gpt2.supports, layouts=LAYOUTS)
spec_loss_gathered = Spec(gpt2.build, parallelize_gathered, gpt2.inputs, loss=reference_loss,
                          supports=gpt2.needs_tp, layouts=LAYOUTS)
