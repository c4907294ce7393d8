"""The GPT-2-style decoder of `gpt2_tp_fsdp.py` with context parallelism through torch's `context_parallel`, as
torchtitan trains it: the sequence sharded over the "cp" ranks (load-balanced, head and tail chunks together),
ring attention in every block, FSDP over the cp ranks so their gradients are averaged.

    paracheck run --spec examples/gpt2_context_parallel.py:spec --nproc 2 --backend nccl     # cp2, cp2 x ...
    paracheck run --spec examples/gpt2_context_parallel.py:spec_wrong_order --nproc 2 --backend nccl

torch 2.13 runs `context_parallel` on the CUDA SDPA kernels only: on CPU (gloo) every cp case is a skip naming
why ("aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy registered"), as
the spec says `context_parallel = True`.

The model enters `context_parallel` in its own forward, since the kit calls the forward: its tokens and positions
are the buffers torch shards on the sequence (each rank's shard, in the load balancer's order), attention inside
runs torch's ring attention, and the logits are put back whole before they are returned: gathered over the cp
ranks (differentiably: each rank computes the loss on the whole logits, and the gather's backward hands each its
part) and restored to the sequence's order with the load balancer's restore indices, as `context_parallel_unshard`
does (which is not differentiable). Every cp rank then holds the whole output, which the kit compares.

`spec_wrong_order` plants the bug: the logits gathered in rank order, not put back in the sequence's order, so
with load balancing the tokens' logits come back permuted (a sequence shard in the wrong order).
"""

from __future__ import annotations

import functools
import os
import sys

import torch

from paracheck.adapters.torch.spec import Spec

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # gpt2_tp_fsdp.py beside this file, by its name
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (compile imports a checkpointed block's module)
import gpt2_tp_fsdp as gpt2  # noqa: E402


def unshard(local, cp_mesh, restore: bool = True):
    """`local` (batch, sequence shard, ...) whole on every cp rank, in the sequence's order (`restore=False`: in the
    ranks' order, the planted bug)."""
    from torch.distributed._functional_collectives import all_gather_tensor_autograd
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _create_default_load_balancer

    whole = all_gather_tensor_autograd(local.contiguous(), gather_dim=1, group=cp_mesh)
    balancer = _create_default_load_balancer(whole.shape[1], cp_mesh.size(), whole.device)
    if balancer is None or not restore:
        return whole
    return whole.index_select(1, balancer._generate_indices(restore=True)[0])


class ContextParallel(torch.nn.Module):
    """The decoder, its forward inside torch's context_parallel over `cp_mesh` (None: the plain forward)."""

    def __init__(self, model, cp_mesh=None, restore: bool = True):
        super().__init__()
        self.model, self.cp_mesh, self.restore = model, cp_mesh, restore

    def forward(self, tokens):
        if self.cp_mesh is None:
            return self.model(tokens)
        from torch.distributed.tensor.experimental import context_parallel

        tokens = tokens.clone()  # sharded in place
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens).clone()
        with context_parallel(self.cp_mesh, buffers=[tokens, positions], buffer_seq_dims=[1, 1],
                              no_restore_buffers={tokens, positions}):
            logits = self.model(tokens, positions)
        return unshard(logits, self.cp_mesh, self.restore)


def build():
    return ContextParallel(gpt2.build())


def parallelize(model, mesh, layout, restore: bool = True):
    """The cp mesh handed to the model's forward; FSDP over (fsdp, cp) flattened, torchtitan's dp_shard_cp, so each
    parameter's gradient is averaged over every rank that computed a part of it."""
    if layout.cp > 1:
        model.cp_mesh, model.restore = mesh["cp"], restore
    shard_dims = tuple(d for d in ("fsdp", "cp") if d in layout.mesh_dims)
    if shard_dims:
        dp_mesh = mesh[shard_dims]._flatten("_".join(shard_dims)) if len(shard_dims) > 1 else mesh[shard_dims]
        gpt2.apply_fsdp(model.model, dp_mesh)
    return model


def supports(layout) -> str | None:
    if layout.tp > 1 or layout.dp > 1 or layout.pp > 1:
        return "this example composes context parallelism with FSDP only"
    if gpt2.SEQ % (2 * layout.cp):
        return f"sequence {gpt2.SEQ} must split into 2 x cp{layout.cp} load-balanced chunks"
    return None


LAYOUTS = ("cp2", "cp4", "cp2xfsdp2", "fsdp2")
spec = Spec(build, parallelize, gpt2.inputs, loss=gpt2.cross_entropy, supports=supports, layouts=LAYOUTS,
            context_parallel=True)
spec_wrong_order = Spec(build, functools.partial(parallelize, restore=False), gpt2.inputs, loss=gpt2.cross_entropy,
                        supports=supports, layouts=("cp2", "cp4", "cp2xfsdp2"), context_parallel=True)
