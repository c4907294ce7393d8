"""The GPT-2-style decoder of `gpt2_tp_fsdp.py` cut into pipeline stages and run by a `torch.distributed.pipelining`
schedule, written as torchtitan writes `pipeline_llm`.

    paracheck run --spec examples/gpt2_pipeline.py:spec --nproc 2                # GPipe on pp2
    paracheck run --spec examples/gpt2_pipeline.py:spec_1f1b --nproc 4          # 1F1B on pp4, pp2xfsdp2
    paracheck run --spec examples/gpt2_pipeline.py:spec_interleaved --nproc 2   # interleaved 1F1B, 2 stages a rank
    paracheck run --spec examples/gpt2_pipeline.py:spec_frozen --nproc 2        # planted bug: parity.grads fails

The model has 4 blocks and an untied head (a head tied to the embedding would live on the first and the last stage
at once). `pipeline(model, mesh, layout, loss_fn)` cuts it as torchtitan's `pipeline_module_split` does: each
stage is a deep copy of the whole model with the blocks it does not hold deleted, the embeddings kept on the first
stage only and the final norm and head on the last, so every parameter keeps its name. Each rank builds a
`PipelineStage` per stage it holds (one; two for the interleaved schedule, stages r and r + pp, "loop" style) on the
mesh's "pp" group, applies FSDP to its parts over the data-parallel dimensions, and returns them with the schedule,
built with the kit's `loss_fn` and as many microbatches as stages (1F1B's minimum).

`spec_frozen` plants a bug in the cut: stage 0 freezes the last block it holds (`requires_grad_(False)`, meant for
the embeddings), so that block's parameters get no gradient while the rest of the pipeline trains.
"""

from __future__ import annotations

import copy
import functools
import os
import sys

from paracheck.adapters.torch.spec import Spec

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # gpt2_tp_fsdp.py beside this file, by its name
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (compile imports a checkpointed block's module)
import gpt2_tp_fsdp as gpt2  # noqa: E402

LAYERS = 4


def build():
    return gpt2.build(layers=LAYERS, tie=False)


def cut(model, stage: int, stages: int, freeze_last: bool = False):
    """Stage `stage` of `stages`: a copy of `model` holding its share of the blocks (the embeddings on the first
    stage, the final norm and head on the last). `freeze_last`: the planted bug (see the module docstring)."""
    part = copy.deepcopy(model)
    per = len(model.h) // stages
    keep = [str(i) for i in range(stage * per, (stage + 1) * per)]
    for name in list(part.h):
        if name not in keep:
            del part.h[name]
    if stage > 0:
        part.wte = part.wpe = None
    if stage < stages - 1:
        part.ln_f = part.lm_head = None
    if freeze_last and stage == 0:
        part.h[keep[-1]].requires_grad_(False)
    return part


def pipeline(model, mesh, layout, loss_fn, schedule: str = "ScheduleGPipe", virtual: int = 1,
             freeze_last: bool = False):
    """This rank's stages ("loop" order: rank r holds stages r, r + pp, ...) and the schedule that runs them, over
    as many microbatches as there are stages (1F1B's minimum)."""
    import torch
    from torch.distributed.pipelining import PipelineStage, schedules

    pp_mesh = mesh["pp"]
    rank, stages = pp_mesh.get_local_rank(), layout.pp * virtual
    device = next(model.parameters()).device
    held = []
    for index in range(rank, stages, layout.pp):
        part = cut(model, index, stages, freeze_last)
        if layout.dp_dims:
            gpt2.apply_fsdp(part, mesh[layout.dp_dims])
        held.append(PipelineStage(part, index, stages, torch.device(device), group=pp_mesh.get_group()))
    kind = getattr(schedules, schedule)
    return held, kind(held[0] if virtual == 1 else held, n_microbatches=stages, loss_fn=loss_fn)


def not_cut(model, mesh, layout):
    raise NotImplementedError("this spec pipelines: it runs layouts with pp only")


def supports(layout) -> str | None:
    if layout.tp > 1 or layout.cp > 1:
        return "this example pipelines with FSDP, not TP or CP"
    if layout.dp > 1 and layout.fsdp == 1:
        return "replicas without an FSDP dimension: this plan shards with fully_shard (use dpNxfsdpM)"
    return None


def _spec(layouts, **options):
    return Spec(build, not_cut, gpt2.inputs, loss=gpt2.cross_entropy, supports=supports, layouts=layouts,
                pipeline=functools.partial(pipeline, **options))


spec = _spec(("pp2", "pp4"))
spec_1f1b = _spec(("pp2", "pp4", "pp2xfsdp2"), schedule="Schedule1F1B")
spec_interleaved = _spec(("pp2",), schedule="ScheduleInterleaved1F1B", virtual=2)
spec_frozen = _spec(("pp2", "pp4"), freeze_last=True)
