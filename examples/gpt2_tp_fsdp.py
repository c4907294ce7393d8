"""A GPT-2-style decoder and the parallelize function a torchtitan user writes for it: TP with sequence
parallelism, activation checkpointing, per-block torch.compile, FSDP2 per block and on the root.

    paracheck run --spec examples/gpt2_tp_fsdp.py:spec --nproc 4              # TP + SP, then FSDP
    paracheck run --spec examples/gpt2_tp_fsdp.py:spec_ac --nproc 4           # + checkpoint_wrapper per block
    paracheck run --spec examples/gpt2_tp_fsdp.py:spec_compile --nproc 4      # torch.compile per block (inductor)
    paracheck run --spec examples/gpt2_tp_fsdp.py:spec_loss_parallel --nproc 4  # logits left vocab-sharded

The model: token and position embeddings, per block LayerNorm -> attention (c_q, c_k, c_v, c_proj, with biases)
and LayerNorm -> MLP (c_fc, GELU, c_proj), a final LayerNorm and a head tied to the token embedding (dim 32,
4 heads, vocabulary 64, sequence 8, batch 4). `parallelize` applies what torchtitan applies, in its order:
tensor parallelism (`apply_tp`), activation checkpointing (`apply_ac`: `checkpoint_wrapper` around each block),
compile (`apply_compile`: each block compiled on its own), then FSDP (`apply_fsdp`: each block its own unit, the
root last). The wrappers put `_checkpoint_wrapped_module.` and `_orig_mod.` into every parameter's name; the kit
reads names through them.

`spec_loss_parallel` keeps the head's logits sharded on the vocabulary (a DTensor, `Shard(-1)`) and computes
the cross-entropy inside torch's `loss_parallel()`, as torchtitan does with `enable_loss_parallel`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from paracheck.adapters.torch.spec import Spec

DIM, LAYERS, HEADS, VOCAB, SEQ, BATCH = 32, 2, 4, 64, 8, 4
#: The backend per-block compile uses by default (inductor compiles C++ on CPU: seconds per block and rank).
COMPILE_BACKEND = "inductor"


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.c_q, self.c_k, self.c_v = (nn.Linear(dim, dim) for _ in range(3))
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x):
        batch, seq, _ = x.shape
        # -1 heads: under TP each rank holds n_heads / tp of them (torchtitan's view).
        q, k, v = (w(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for w in (self.c_q, self.c_k, self.c_v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(dim), Attention(dim, heads), nn.LayerNorm(dim), MLP(dim)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A module a pipeline stage may hold a part of (torchtitan's way): the embeddings, the head and any block may be
    None, and the forward skips what is not there (a later stage's input is the activations)."""

    def __init__(self, dim: int = DIM, layers: int = LAYERS, heads: int = HEADS, vocab: int = VOCAB, seq: int = SEQ,
                 tie: bool = True):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.h = nn.ModuleDict({str(i): Block(dim, heads) for i in range(layers)})
        self.ln_f, self.lm_head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.wte.weight  # tied, as GPT-2's are

    def forward(self, tokens, positions=None):
        x = tokens
        if self.wte is not None:
            # Positions (1, seq): under sequence parallelism wpe's output is sharded on dim 1, as wte's is. Context
            # parallelism hands each rank the positions of its own shard of the sequence.
            if positions is None:
                positions = torch.arange(tokens.shape[1], device=tokens.device)[None]
            x = self.wte(tokens) + self.wpe(positions)
        for block in self.h.values():
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.lm_head is not None else x


def build(**config) -> GPT:
    """GPT-2's initialisation (weights N(0, 0.02), linear biases zero), the norms drawn off 1 and 0 so that a
    norm whose gradient is lost shows."""
    model = GPT(**config)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, 0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.zero_()
            if isinstance(module, nn.LayerNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
    return model


def block_plan() -> dict:
    """One block's plan, torchtitan's with sequence parallelism: the norms SequenceParallel, the sequence
    gathered before attention and the MLP, colwise in, rowwise out and reduce-scattered back onto the sequence."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    gather = functools.partial(PrepareModuleInput, input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {"ln_1": SequenceParallel(), "attn": gather(), "attn.c_q": ColwiseParallel(),
            "attn.c_k": ColwiseParallel(), "attn.c_v": ColwiseParallel(),
            "attn.c_proj": RowwiseParallel(output_layouts=Shard(1)),
            "ln_2": SequenceParallel(), "mlp": gather(), "mlp.c_fc": ColwiseParallel(),
            "mlp.c_proj": RowwiseParallel(output_layouts=Shard(1))}


def model_plan(loss_parallel: bool = False) -> dict:
    """The embeddings rowwise (vocabulary and positions sharded, their sums reduce-scattered onto the sequence),
    the final norm SequenceParallel, the head colwise: its logits gathered whole, or, for `loss_parallel`, left
    sharded on the vocabulary as a DTensor for the loss to take."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    embed = functools.partial(RowwiseParallel, input_layouts=Replicate(), output_layouts=Shard(1))
    head = (ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
            if loss_parallel else ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()))
    return {"wte": embed(), "wpe": embed(), "ln_f": SequenceParallel(), "lm_head": head}


def apply_tp(model: GPT, tp_mesh, plan=block_plan, top=model_plan) -> None:
    """`top()`: the model's own layers' plan; `plan()`: each block's."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, tp_mesh, top())
    # parallelize_module gave wte and lm_head a DTensor each (both Shard(0) on the vocabulary): tie them again.
    model.lm_head.weight = model.wte.weight
    for block in model.h.values():
        parallelize_module(block, tp_mesh, plan())


def apply_ac(model: GPT) -> None:
    """torchtitan's full activation checkpointing: each block wrapped, its activations recomputed in the backward."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for name, block in list(model.h.items()):
        model.h.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False))


def apply_compile(model: GPT, backend: str = COMPILE_BACKEND) -> None:
    """torchtitan's per-block compile: each block replaced by its compiled module (`_orig_mod` inside). Static
    shapes: a batch shard of another size compiles again rather than symbolically (which took minutes on 2 CPUs)."""
    for name, block in list(model.h.items()):
        model.h.register_module(name, torch.compile(block, backend=backend, fullgraph=True, dynamic=False))


def apply_fsdp(model: GPT, dp_mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in model.h.values():
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def parallelize(model: GPT, mesh, layout, *, plan=block_plan, ac: bool = False, compile: bool | str = False,
                loss_parallel: bool = False) -> GPT:
    """torchtitan's order: TP, activation checkpointing, compile (`compile`: True, or the backend's name), FSDP."""
    if layout.tp > 1:
        apply_tp(model, mesh["tp"], plan, functools.partial(model_plan, loss_parallel))
    if ac:
        apply_ac(model)
    if compile:
        apply_compile(model, COMPILE_BACKEND if compile is True else compile)
    if layout.dp_dims:
        apply_fsdp(model, mesh[layout.dp_dims])  # ("dp", "fsdp") is HSDP: replicas of an FSDP group
    return model


def inputs(layout, variant: str = "base") -> dict:
    return {"tokens": torch.randint(0, VOCAB, (BATCH, SEQ))}


def targets(tokens):
    """Next-token targets: the tokens shifted left, the last position predicting token 0."""
    return torch.roll(tokens, -1, dims=1)


def cross_entropy(logits, batch):
    """Next-token cross-entropy, a mean over the batch (and its tokens). Logits sharded on the vocabulary (a
    DTensor, `Shard(-1)`) are taken inside torch's `loss_parallel()`, which computes it without gathering them."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    labels = targets(batch["tokens"])
    if isinstance(logits, DTensor):
        from torch.distributed.tensor import Replicate

        labels = DTensor.from_local(labels, logits.device_mesh, [Replicate()])
        with loss_parallel():
            return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))


def supports(layout) -> str | None:
    if layout.dp > 1 and layout.fsdp == 1:
        return "replicas without an FSDP dimension: this plan shards with fully_shard (use dpNxfsdpM)"
    if HEADS % layout.tp or SEQ % layout.tp:
        return f"{HEADS} heads and sequence {SEQ} must split over tp{layout.tp}"
    return None


def needs_tp(layout) -> str | None:
    return supports(layout) or (None if layout.tp > 1 else "loss parallelism shards the vocabulary over tp")


LAYOUTS_2 = ("tp2", "fsdp2")
LAYOUTS_4 = ("tp4", "fsdp4", "tp2xfsdp2", "dp2xfsdp2")
spec = Spec(build, parallelize, inputs, supports=supports)
#: Activation checkpointing per block, before FSDP (torchtitan's `apply_ac`).
spec_ac = Spec(build, functools.partial(parallelize, ac=True), inputs, supports=supports)
#: Each block compiled on its own (torchtitan's `apply_compile`).
spec_compile = Spec(build, functools.partial(parallelize, compile=True), inputs, supports=supports)
#: Both, in torchtitan's order: each block checkpointed, then compiled. On TP layouts torch 2.13's AOTAutograd
#: raises in the training forward (a declared upstream failure: docs/upstream/torch_compile_checkpoint_dtensor.md).
spec_ac_compile = Spec(build, functools.partial(parallelize, ac=True, compile=True), inputs, supports=supports)
#: The logits left vocab-sharded for torch's loss_parallel (TP layouts only).
spec_loss_parallel = Spec(build, functools.partial(parallelize, loss_parallel=True), inputs, loss=cross_entropy,
                          supports=needs_tp)
