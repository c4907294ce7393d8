"""The plans of `llama_tp_fsdp.py` with one planted bug each, both caught on every rank:

`spec`: (the plan without sequence parallelism) the MLP's w2 is RowwiseParallel with its output left Partial,
so the all-reduce that sums the TP ranks' partial products never runs: parity.forward, inference, loss, grads.
`spec_norms`: (torchtitan's plan) the block norms left out of the plan, so their weight gradients are never
all-reduced over the TP ranks: the forward is exact, parity.grads fails naming the norm weights.

    paracheck run --spec examples/llama_tp_fsdp_bug.py:spec --nproc 4 --layouts tp2xfsdp2         # fails, ranks 0-3
    paracheck run --spec examples/llama_tp_fsdp_bug.py:spec_norms --nproc 4 --layouts tp2xfsdp2   # fails, ranks 0-3
"""

from __future__ import annotations

import importlib.util
import os

from paracheck.adapters.torch.spec import Spec

_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama_tp_fsdp.py")
_loader = importlib.util.spec_from_file_location("paracheck_example_llama_tp_fsdp", _path)
llama = importlib.util.module_from_spec(_loader)
_loader.loader.exec_module(llama)


def partial_w2(sequence_parallel: bool = False) -> dict:
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor.parallel import RowwiseParallel

    plan = llama.block_plan(sequence_parallel=False)
    # The bug: w2's partial products handed on as they are; the all-reduce that sums them never runs.
    plan["feed_forward.w2"] = RowwiseParallel(output_layouts=Partial())
    return plan


def parallelize(model, mesh, layout):
    return llama.parallelize(model, mesh, layout, plan=partial_w2, sequence_parallel=False)


def norms_left_out(sequence_parallel: bool = True) -> dict:
    plan = llama.block_plan(sequence_parallel=True)
    # The bug: the block norms not SequenceParallel. The forward is right (a norm is per token), but each TP
    # rank's norm weight gradient sums only its share of the sequence, and nothing all-reduces it.
    del plan["attention_norm"], plan["ffn_norm"]
    return plan


def parallelize_norms(model, mesh, layout):
    return llama.parallelize(model, mesh, layout, plan=norms_left_out)


LAYOUTS = ("tp2", "tp4", "tp2xfsdp2", "fsdp4")
spec = Spec(llama.build, parallelize, llama.inputs, supports=llama.supports, layouts=LAYOUTS)
spec_norms = Spec(llama.build, parallelize_norms, llama.inputs, supports=llama.supports, layouts=LAYOUTS)
