"""Localization across pipeline stages: each stage compares the modules it holds, and one pipeline's stages
join their traces into one.

A stage holds some of the model's modules; the others are placeholders (an identity standing in for a layer
another stage holds). `held`: the modules a stage computes whole, neither a placeholder nor around one (a
layer and its projections, a rotary embedding every stage runs; not the decoder around the layers). Each stage's
calls of those are put back together over its own groups (TP), from a table of its own ranks' shapes only, and
held to the reference's calls of the same modules (`stage_trace`). Then the ranks of one pipeline (one rank per
stage, the same batch shard and TP coordinate) take every stage's compared calls, in the reference's execution
order, and find the first beyond tolerance and its origin over the whole model (`join`), so every rank names the
same module whatever its stage. Each module's entry says which stage compared it (`stage`); a module no stage
holds whole (one around layers of several stages) is in `not_compared`, saying so; each stage after the first
says whether what it was handed agreed (`boundaries`: the inputs of the first module that stage alone holds).
"""

from __future__ import annotations

from dataclasses import replace

from paracheck.checks import localize
from paracheck.domain.localization import Boundary, ForwardLocalization, Skipped


def held(model, is_placeholder) -> set[str]:
    """The modules of this stage's `model` it computes whole: no placeholder in or around them (pure)."""
    out = set()
    for name, module in model.named_modules():
        if not any(is_placeholder(m) for m in module.modules()):
            out.add(name or "<root>")
    return out


def stage_trace(calls: list, ref_calls: list, groups: list, whole: set, atol: float, rtol: float, stage: int,
                pipeline, holds: set, last: bool) -> ForwardLocalization:
    """One pass's localization on a pipeline-parallel model (collective: three object gathers over the world,
    every rank's stage, the table of shapes and the compared calls, and the tensor gathers of this stage's groups). `stage`: this rank's; `pipeline`: what names this rank's pipeline
    (equal on its stages' ranks); `holds`: `held` on this stage; `last`: whether it computes the model's output,
    which every stage then returns (so the root, in `whole`, is compared there)."""
    import torch.distributed as dist

    compared = holds | (whole if last else set())
    mine = [c for c in calls if c.name in compared]
    ref_mine = [c for c in ref_calls if c.name in compared]
    stages = localize.all_gather_object(stage)

    def own_stage(obj):
        return [entry if stages[r] == stage else [] for r, entry in enumerate(localize.all_gather_object(obj))]

    gathered, not_compared = localize.gather_trace(mine, ref_mine, groups, whole, own_stage, dist.get_rank())
    entries = localize.compare_calls(gathered, ref_mine, atol, rtol)
    parts = [part for key, *part in localize.all_gather_object((pipeline, stage, entries, not_compared, holds))
             if key == pipeline]
    return replace(join(parts, ref_calls), stage=stage, atol=atol, rtol=rtol)


def join(parts: list[tuple], ref_calls: list) -> ForwardLocalization:
    """One pipeline's localization from its stages' parts, (stage, compared calls, not compared, held) each
    (pure): every compared call in the reference's execution order, tagged with its stage."""
    tagged = sorted(((e, stage) for stage, entries, _, _ in parts for e in entries), key=lambda t: (t[0].end, t[1]))
    found = localize.compare_traces([e for e, _ in tagged])
    stage_of = {}
    for e, s in tagged:
        stage_of.setdefault(e.key, s)  # the first stage that compared it
    modules = tuple(replace(m, stage=s) for m, (_, s) in zip(found.modules, tagged))
    first, last = (None if m is None else replace(m, stage=stage_of[m.module])
                   for m in (found.first, found.last_agreeing))
    seen = {e.key for e, _ in tagged}
    skipped = [replace(n, stage=stage) for stage, _, not_compared, _ in parts for n in not_compared
               if n.module not in seen]
    listed = seen | {n.module for n in skipped}
    skipped += [Skipped(c.key, "around modules of several pipeline stages: no stage holds it whole")
                for c in ref_calls if c.key not in listed]
    return replace(found, modules=modules, first=first, last_agreeing=last, not_compared=tuple(skipped),
                   boundaries=tuple(boundaries(tagged, parts)))


def boundaries(tagged: list, parts: list[tuple]) -> list[Boundary]:
    """For each stage after the first, the first module only it holds and whether its inputs (what the stage
    before handed on) agreed."""
    out = []
    for stage, _, _, holds in sorted(parts, key=lambda p: p[0]):
        others = set().union(*(h for s, _, _, h in parts if s != stage))
        alone = [e for e, s in tagged if s == stage and e.name in holds - others]
        if stage == min(p[0] for p in parts) or not alone:
            continue
        entry = min(alone, key=lambda e: e.start)
        out.append(Boundary(stage, entry.key, entry.inputs.within, entry.inputs.max_abs))
    return out
