"""A small llama-style decoder and its TP + FSDP plan, written the way torchtitan writes a parallelize function.

    paracheck run --spec examples/llama_tp_fsdp.py:spec --nproc 4

The model: token embedding, per block RMSNorm -> attention (wq, wk, wv, wo; rotary positions) and RMSNorm ->
SwiGLU MLP (w1, w2, w3), a final RMSNorm and the output head. `parallelize` applies tensor parallelism with
sequence parallelism as torchtitan's `apply_tp` does (ColwiseParallel on wq/wk/wv/w1/w3, RowwiseParallel on wo/w2,
SequenceParallel on the norms, PrepareModuleInput before attention and the MLP, on the mesh's "tp" dimension;
attention then runs n_heads / tp local heads), then `fully_shard` per block and on the whole model over the
data-parallel dimensions ("fsdp", with "dp" replicas: HSDP).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paracheck.adapters.torch.spec import Spec

DIM, LAYERS, HEADS, VOCAB, SEQ, BATCH = 32, 2, 4, 64, 8, 4


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # Weights drawn off 1 by `init`, so a norm whose gradient is lost shows in the gradients.
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(seq: int, head_dim: int, theta: float = 10000.0):
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq).float(), freqs)
    return angles.cos(), angles.sin()


def apply_rotary(x, cos, sin):
    """x: (batch, seq, heads, head_dim); rotates pairs (even, odd) by the position's angle."""
    even, odd = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos, sin):
        batch, seq, _ = x.shape
        # -1 heads: under TP each rank holds n_heads / tp of them (torchtitan's view).
        q, k, v = (w(x).view(batch, seq, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
        self.attention, self.feed_forward = Attention(dim, heads), FeedForward(dim, 2 * dim)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Decoder(nn.Module):
    def __init__(self, dim: int = DIM, layers: int = LAYERS, heads: int = HEADS, vocab: int = VOCAB, seq: int = SEQ):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, heads) for i in range(layers)})
        self.norm, self.output = RMSNorm(dim), nn.Linear(dim, vocab, bias=False)
        cos, sin = rotary(seq, dim // heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        cos, sin = self.cos[: tokens.shape[1]], self.sin[: tokens.shape[1]]
        for block in self.layers.values():
            x = block(x, cos, sin)
        return self.output(self.norm(x))


def build() -> Decoder:
    model = Decoder()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.uniform_(0.5, 1.5)
    return model


def block_plan(sequence_parallel: bool = True) -> dict:
    """One block's TP plan, torchtitan's: colwise q/k/v/w1/w3, rowwise wo/w2. With sequence parallelism (as
    torchtitan always runs it) the norms are SequenceParallel (activations sharded on the sequence between the
    layers), their output is gathered before attention and the MLP, and wo/w2 reduce-scatter back onto it."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(), "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(), "feed_forward.w3": ColwiseParallel()}
    if sequence_parallel:
        plan.update({
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
    return plan


def model_plan(sequence_parallel: bool = True) -> dict:
    """The model's own layers: the output head colwise with its logits gathered whole (no loss parallelism);
    with sequence parallelism also the embedding rowwise (vocabulary sharded, output reduce-scattered onto the
    sequence) and the final norm SequenceParallel."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if not sequence_parallel:
        return {"output": ColwiseParallel(output_layouts=Replicate())}
    return {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}


def parallelize(model: Decoder, mesh, layout, plan=block_plan, sequence_parallel: bool = True) -> Decoder:
    """torchtitan's order: tensor parallelism on the "tp" dimension first, then FSDP over the data-parallel
    dimensions, each block its own unit and the root last."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    if layout.tp > 1:
        tp_mesh = mesh["tp"]
        parallelize_module(model, tp_mesh, model_plan(sequence_parallel))
        for block in model.layers.values():
            parallelize_module(block, tp_mesh, plan(sequence_parallel))
    if layout.dp_dims:
        dp_mesh = mesh[layout.dp_dims]  # ("dp", "fsdp") is HSDP: replicas of an FSDP group
        for block in model.layers.values():
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    return model


def parallelize_no_sp(model: Decoder, mesh, layout) -> Decoder:
    return parallelize(model, mesh, layout, sequence_parallel=False)


def inputs(layout, variant: str = "base") -> dict:
    return {"tokens": torch.randint(0, VOCAB, (BATCH, SEQ))}


def supports(layout) -> str | None:
    if layout.dp > 1 and layout.fsdp == 1:
        return "replicas without an FSDP dimension: this plan shards with fully_shard (use dpNxfsdpM)"
    if HEADS % layout.tp:
        return f"{HEADS} heads do not split over tp{layout.tp}"
    return None


spec = Spec(build, parallelize, inputs, supports=supports)
#: The same plan without sequence parallelism (activations replicated between the layers).
spec_no_sp = Spec(build, parallelize_no_sp, inputs, supports=supports)
