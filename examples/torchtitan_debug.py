"""torchtitan's own llama3 debug model and its own `parallelize_llama`, run by the torch adapter.

    pip install torchtitan==0.3.0 spmd-types einops tyro triton   # (0.3.0 imports triton even on CPU)
    paracheck run --spec examples/torchtitan_debug.py:spec --nproc 4 --layouts tp2xfsdp2

The model is torchtitan's `debugmodel` flavour shrunk to 2 layers (dim 256, 16 heads, vocabulary 2048). Its
config asks for flex attention (0.3.0 refuses "sdpa" for language models), but flex attention has no backward
on CPU, so each block's inner attention config is swapped for torchtitan's own causal
`ScaledDotProductAttention` (keeping the sharding declaration torchtitan gave it) before building. It is wrapped in a module whose forward gives it positions, so the kit sees a plain
tokens -> logits module. `parallelize` hands torchtitan's `parallelize_llama` a `ParallelDims` of the
layout's degrees; torchtitan builds its own meshes from it (its dimension names "fsdp" and "tp" match the
kit's tokens), in fp32 (mixed precision off), without compile or activation checkpointing.

Two bends for CPU ranks, both outside torchtitan's plan: torchtitan picks its device type once at import
(`tools.utils.device_type`, "cuda" when no accelerator is found), so the spec points its mesh builder at "cpu";
and torchtitan's FSDP reduces with PREMUL_SUM, which gloo lacks, so the spec asks FSDP for SUM reductions
scaled apart (`set_force_sum_reduction_for_comms`), the same average.
"""

from __future__ import annotations

import tempfile

import torch
from torch import nn

from paracheck.adapters.torch.spec import Spec

LAYERS, BATCH, SEQ = 2, 4, 16


class WithPositions(nn.Module):
    """torchtitan's decoder, given the positions its trainer gives it."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
        return self.inner(tokens, positions=positions)


def _config():
    import dataclasses

    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import llama3_configs
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    config = llama3_configs["debugmodel"](attn_backend="flex")
    config = dataclasses.replace(config, layers=config.layers[:LAYERS])
    # What torchtitan's trainer does before building (`update_from_config`, whose import of the trainer needs
    # torchdata): fill every sub-config's sharding declarations, the plan `parallelize_llama` applies, sequence
    # parallelism on, as its default is.
    set_llama3_sharding_config(config, enable_sp=True)
    for layer in config.layers:
        # torchtitan's own causal SDPA module in place of flex attention (no backward on CPU), keeping the
        # local_map declaration the sharding config gave the inner attention.
        layer.attention.inner_attention = ScaledDotProductAttention.Config(
            sharding_config=layer.attention.inner_attention.sharding_config)
    return config


def build() -> nn.Module:
    model = _config().build()
    model.init_states()
    return WithPositions(model)


def parallelize(model: WithPositions, mesh, layout):
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import parallel_dims as titan_dims
    from torchtitan.models.llama3 import parallelize_llama

    titan_dims.device_type = mesh.device_type  # torchtitan chose "cuda" at import on a machine without one
    parallelism = ParallelismConfig(data_parallel_replicate_degree=layout.dp, data_parallel_shard_degree=layout.fsdp,
                                    tensor_parallel_degree=layout.tp, spmd_backend="partial_dtensor")
    dims = titan_dims.ParallelDims.from_config(parallelism, layout.world)
    dims.build_mesh()
    training = TrainingConfig(local_batch_size=BATCH // layout.dp_degree, seq_len=SEQ,
                              mixed_precision_param="float32")
    parallelize_llama(model.inner, parallel_dims=dims, training=training, parallelism=parallelism,
                      compile_config=CompileConfig(enable=False), ac_config=None,
                      dump_folder=tempfile.gettempdir())
    if mesh.device_type == "cpu":
        _sum_reductions(model)
    return model


def _sum_reductions(model) -> None:
    """torchtitan sets FSDP's gradient divide factor, which reduces with PREMUL_SUM; gloo has none, so FSDP is
    told to reduce with SUM and scale apart (the same average)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def inputs(layout, variant: str = "base") -> dict:
    return {"tokens": torch.randint(0, 2048, (BATCH, SEQ))}


#: torchtitan's FSDP sums gradients (divide factor 1; its trainer scales the loss by the global token count).
spec = Spec(build, parallelize, inputs, layouts=("tp2", "fsdp2", "tp4", "fsdp4", "tp2xfsdp2"), grad_reduction="sum")
