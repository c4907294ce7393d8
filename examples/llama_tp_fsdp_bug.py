"""The plan of `llama_tp_fsdp.py` with one planted bug: the MLP's w2 is RowwiseParallel with its output left
Partial, so the all-reduce that sums the TP ranks' partial products never runs (each rank returns its own share).

    paracheck run --spec examples/llama_tp_fsdp_bug.py:spec --nproc 4 --layouts tp2xfsdp2   # fails, ranks 0-3
"""

from __future__ import annotations

import importlib.util
import os

from paracheck.adapters.torch.spec import Spec

_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama_tp_fsdp.py")
_loader = importlib.util.spec_from_file_location("paracheck_example_llama_tp_fsdp", _path)
llama = importlib.util.module_from_spec(_loader)
_loader.loader.exec_module(llama)


def buggy_plan():
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor.parallel import RowwiseParallel

    plan = llama.block_plan()
    plan["feed_forward.w2"] = RowwiseParallel(output_layouts=Partial())  # the bug: no all-reduce of w2's output
    return plan


def parallelize(model, mesh, layout):
    return llama.parallelize(model, mesh, layout, plan=buggy_plan)


spec = Spec(llama.build, parallelize, llama.inputs, supports=llama.supports,
            layouts=("tp2", "tp4", "tp2xfsdp2", "fsdp4"))
