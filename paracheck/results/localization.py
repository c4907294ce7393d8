"""Localization over ranks: every rank's finding for a failing parity check merged into the case's one.

Torch-free. A rank's check carries its finding in `data["localization"]` (`checks.localize` builds it); the
case's JSON gets `localization: {"forward": ..., "grads": ...}` (and `"inference"` when the no-grad pass failed
as well as the training one, `"steps"` where a failing parity.steps was rerun at its first parting step): the
finding of the first rank that failed the check, with `ranks` (the ranks that found the same) and `other_ranks`
(rank -> what it found instead), so no rank's answer is dropped.
"""

from __future__ import annotations

from dataclasses import replace

from paracheck.domain.localization import (ForwardLocalization, GradRow, GradsLocalization, Localization, Merged,
                                           Planted, StepsLocalization)
from paracheck.domain.records import CheckId, CheckResult

KEY = "localization"
#: The part a failing generation's finding is under (a forward trace over the decode steps, with `decode_step`).
GENERATE = "generate"
#: Why a failing case was not rerun with hooks (a declared known failure explains it: `rank.declared`).
NOT_RUN = "not_run"
#: Each part a rank's check data may hold, and the record it reads as.
RECORDS = {"forward": ForwardLocalization, GENERATE: ForwardLocalization, "grads": GradsLocalization,
           "steps": StepsLocalization}


def strip(data: dict) -> dict:
    """A check's data without its localization (the case carries the merged one)."""
    return {k: v for k, v in data.items() if k != KEY}


def merge(per_check: dict) -> Localization:
    """`per_check`: check id -> [(rank, CheckResult)]; the case's localization (empty when no rank has one)."""
    found = {}
    forward = [(CheckId.FORWARD, "forward"), (CheckId.INFERENCE, "inference"), (CheckId.PIPELINE, "pipeline")]
    for check_id, part in forward + [(CheckId.GRADS, "grads"), (CheckId.GENERATE, GENERATE)]:
        merged = _one(per_check.get(check_id, []), "grads" if check_id == CheckId.GRADS else
                      GENERATE if check_id == CheckId.GENERATE else "forward")
        if merged is not None:
            found[part] = merged
    if "forward" not in found and "inference" in found:
        found["forward"] = found.pop("inference")  # the no-grad pass is the forward that failed
    if "forward" not in found and "pipeline" in found:
        found["forward"] = found.pop("pipeline")  # a pipeline's transformer call at the first step that failed
    found.pop("pipeline", None)
    steps = _one(per_check.get(CheckId.STEPS, []), "steps")
    if steps is not None:
        found["steps"] = steps
    not_run = [c.data[KEY][NOT_RUN] for held in per_check.values() for _, c in held
               if NOT_RUN in (c.data or {}).get(KEY, {})]
    if not_run:
        found[NOT_RUN] = not_run[0]  # every rank decided alike (`rank.declared`), with the same reasons
    return Localization(**found)


def _one(per_rank: list[tuple[int, CheckResult]], part: str):
    """The part's record as the first failing rank found it, merged: the ranks that found the same, and what
    each other rank found instead."""
    held = [(rank, RECORDS[part].from_json(c.data[KEY][part])) for rank, c in per_rank
            if part in (c.data or {}).get(KEY, {})]
    if not held:
        return None
    failing = [rank for rank, c in per_rank if c.status.value == "fail"]
    shown_rank, shown = next(((r, f) for r, f in held if r in failing), held[0])
    same = [r for r, f in held if _identity(f, part) == _identity(shown, part)]
    others = {str(r): _identity(f, part) for r, f in held if r not in same}
    return replace(shown, merged=Merged(shown_rank, tuple(same), others))


def _identity(found, part: str):
    """What two ranks must agree on to have found the same thing."""
    if part == "grads":
        return found.pattern
    if part == "steps":
        return {"step": found.step, "where": found.where, "origin": found.origin}
    same = {"first": found.first.module if found.first else None, "origin": found.origin}
    return dict(same, decode_step=found.decode_step) if part == GENERATE else same


def planted(control, found: Localization, planted_in: str | None = None) -> Planted | None:
    """For a control that declares `plants_in`: what the case's localization named and whether it is the
    planted place (`Control.planted_at`; `planted_in`: the place the case's planter reported, for a
    `{planted}` glob, then also in the answer). A control that must trip a forward check is judged by the
    forward's origin, one that must trip the gradients by theirs; one that breaks numbers as a side effect by
    whichever it broke. None when the control declares no place or nothing was localized."""
    if not control.plants_in or not found:
        return None
    forward_first = any(c in (CheckId.FORWARD, CheckId.INFERENCE) for c in control.must_trip)
    order = ("forward", "grads") if forward_first or CheckId.GRADS not in control.must_trip else ("grads", "forward")
    if CheckId.GENERATE in control.must_trip:
        order = (GENERATE,) + order
    part = next((p for p in order if found.part(p) is not None), None)
    if part is None:
        return None
    named = found.part(part).origin
    return Planted(control.plants_in, named, part, control.planted_at(named, planted_in), planted_in or None)


def note(localization: Localization) -> list[str]:
    """The report's lines for a case's localization: where the forward first differs, the top gradients."""
    lines = []
    for part, _, found in localization.forward_parts():
        step = f" (decode step {found.decode_step})" if found.decode_step is not None else ""
        lines.append(f"{found.pass_name or part} pass on {_ranks(found.merged)}: {forward_line(found)}{step}")
    grads = localization.grads
    if grads and grads.pattern:
        origin = f" (origin {grads.origin}, from the {grads.origin_from or 'gradient table'})" if grads.origin else ""
        lines.append(f"grads on {_ranks(grads.merged)}: {grads.pattern}{origin}")
        lines.extend(f"  {grad_line(e)}" for e in (grads.params or ())[:TOP])
    if grads and grads.error:
        lines.append(f"grads: {grads.error}")
    if localization.not_run:
        lines.append(localization.not_run)
    return lines


def steps_line(found: StepsLocalization, failing: list | None = None) -> str:
    """Where a failing parity.steps' rerun of its first parting step found the parting (its `where`: the
    forward, the gradients, or the update); `failing`: the parameters that step's records name."""
    if found.error:
        return f"step {found.step}: {found.error}"
    step = f"step {found.step} rerun from where it began"
    if found.where == "forward":
        first = found.forward.first if found.forward else None
        return (f"{step}: the forward first leaves the reference at {first.module if first else '?'} (max_abs "
                f"{_num(first.max_abs if first else None)}), arising in {found.origin}")
    if found.where == "gradients":
        pattern = found.grads.pattern if found.grads else None
        return f"{step}: the forward agrees; the gradients part, origin {found.origin} ({pattern})"
    named = f", first in {failing[0]}" if failing else ""
    return (f"{step}: the forward and every gradient agree with the reference's, so the update parts them (the clip, "
            f"the optimizer, or what runs after them){named}")


#: How many parameters the text report lists (the JSON has all).
TOP = 10


def forward_line(found: ForwardLocalization) -> str:
    if found.error:
        return found.error
    first = found.first
    if not first:
        return "no module's output differs beyond tolerance on the rerun" + \
            ("" if found.reproduced is not False else " (the rerun did not reproduce the output)")
    figures = f"max_abs {_num(first.max_abs)}, max_rel {_num(first.max_rel)}" if first.max_abs is not None \
        else first.why
    text = f"first module beyond tolerance: {first.module}{_stage(first.stage)} ({figures})"
    if found.origin and found.origin != first.module:
        text += f", arising in {found.origin} (its inputs agree)"
    last = found.last_agreeing
    text += f"; last agreeing: {last.module}{_stage(last.stage)}" if last else "; no module agreed before it"
    handed = [b.stage for b in found.boundaries or () if not b.inputs_within]
    if handed:
        text += f"; stage{'s' if len(handed) > 1 else ''} {', '.join(map(str, handed))} handed a difference"
    skipped = found.not_compared or ()
    return text + (f"; {len(skipped)} not compared (e.g. {skipped[0].module}: {skipped[0].why})" if skipped else "")


def _stage(stage: int | None) -> str:
    """Which pipeline stage compared a module, where the layout has stages."""
    return f" (stage {stage})" if stage is not None else ""


def grad_line(entry: GradRow) -> str:
    state = "within" if entry.within else "BEYOND"
    over = f", {entry.over:.2g}x bound" if entry.over is not None else ""
    factor = f", {entry.factor:.4g}x the reference" if entry.factor is not None else ""
    figures = f"max_abs {_num(entry.max_abs)}, max_rel {_num(entry.max_rel)}" if entry.max_abs is not None \
        else entry.why
    return f"{state:6} {entry.param} ({figures}{over}{factor})"


def _ranks(merged: Merged) -> str:
    ranks = merged.ranks
    text = "rank " + ",".join(map(str, ranks)) if len(ranks) == 1 else "ranks " + ",".join(map(str, ranks))
    if merged.other_ranks:
        text += f" (other ranks found otherwise: {', '.join(sorted(merged.other_ranks))})"
    return text


def _num(value) -> str:
    return "n/a" if value is None else f"{value:.2e}"
