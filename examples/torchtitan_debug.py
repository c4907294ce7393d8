"""torchtitan's own llama3 debug model and its own `parallelize_llama`, run by the torch adapter.

    pip install torchtitan==0.3.0 spmd-types einops tyro triton   # (0.3.0 imports triton even on CPU)
    paracheck run --spec examples/torchtitan_debug.py:spec --nproc 4 --layouts tp2xfsdp2

The model is torchtitan's `debugmodel` flavour shrunk to 2 layers (dim 256, 16 heads, vocabulary 2048). Its
config asks for flex attention (0.3.0 refuses "sdpa" for language models), but flex attention has no backward
on CPU, so each block's inner attention is swapped for torchtitan's own causal `ScaledDotProductAttention`
module after building. It is wrapped in a module whose forward gives it positions, so the kit sees a plain
tokens -> logits module. `parallelize` hands torchtitan's `parallelize_llama` a `ParallelDims` of the
layout's degrees; torchtitan builds its own meshes from it (its dimension names "fsdp" and "tp" match the
kit's tokens), in fp32 (mixed precision off), without compile or activation checkpointing.

torchtitan picks its device type once at import (`tools.utils.device_type`, "cuda" when no accelerator is
found); on a CPU rank this spec points its mesh builder at "cpu".
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

    from torchtitan.models.llama3 import llama3_configs

    config = llama3_configs["debugmodel"](attn_backend="flex")
    return dataclasses.replace(config, layers=config.layers[:LAYERS]) if isinstance(config.layers, list) else config


def build() -> nn.Module:
    from torchtitan.models.common.attention import ScaledDotProductAttention

    model = _config().build()
    model.init_states()
    for block in model.layers.values():
        # torchtitan's own causal SDPA module: flex attention has no backward on CPU.
        block.attention.inner_attention = ScaledDotProductAttention(ScaledDotProductAttention.Config())
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
    return model


def inputs(layout, variant: str = "base") -> dict:
    return {"tokens": torch.randint(0, 2048, (BATCH, SEQ))}


spec = Spec(build, parallelize, inputs, layouts=("tp2", "fsdp2", "tp4", "fsdp4", "tp2xfsdp2"))
