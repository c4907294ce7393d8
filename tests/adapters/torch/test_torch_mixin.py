"""The torch adapter's pytest mixin: a test class that is its own spec, and one that names the llama example;
each class one 2-rank launch, tests per layout and check, controls included."""

import torch
from torch import nn

from paracheck.adapters.torch.mixin import TorchParallelTesterMixin


class TestMlpIsItsOwnSpec(TorchParallelTesterMixin):
    paracheck_layouts = ("tp2", "fsdp2")

    def build(self):
        return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def parallelize(self, model, mesh, layout):
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if layout.tp > 1:
            parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        if layout.dp_dims:
            fully_shard(model, mesh=mesh[layout.dp_dims])

    def inputs(self, layout, variant):
        return torch.randn(4, 8)


class TestLlamaExample(TorchParallelTesterMixin):
    paracheck_spec = "examples/llama_tp_fsdp.py:spec"
    paracheck_world = 2  # the spec's layouts of 2 ranks: tp2, fsdp2 (dp2 is a skip in the spec's words)
