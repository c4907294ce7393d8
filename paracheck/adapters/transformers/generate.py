"""parity.generate for transformers: greedy `generate` on the parallel model and on the single-process one, held
step by step to `checks.generate`'s rule on every rank, and localized to a module and a decode step on a failure.

Each case generates in three modes (`MODES`): transformers' default (dynamic) cache on prompts without padding, the
same cache on a batch whose every second row is left-padded by `PAD` (`attention_mask` 0 there, as a serving batch
is), and a static cache (`cache_implementation="static"`) on the padded batch, where the single-process model takes
one (where it refuses, the mode is a named `not_run`). Prompts are `PROMPT` random tokens; `NEW` new tokens, never
fewer (`min_new_tokens`), so every run takes the same decode steps. Each data-parallel rank generates on its share
of the rows, as the forward passes do; every rank of a pipeline gets the logits the last stage broadcast. Each mode
is a part of the check (`CheckResult.facets`), so a control is judged on the modes its plain case passes. The
reference's generations are kept for the cases that share them (`_GENERATIONS`).
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import torch.distributed as dist

from paracheck.adapters.transformers.inputs import rows_in, share
from paracheck.checks import generate as rule
from paracheck.checks import localize, rerun
from paracheck.checks.shards import full
from paracheck.domain.localization import ForwardLocalization
from paracheck.domain.records import CheckId, CheckResult, Status
from paracheck.world.recent import Recent

PROMPT = 8
PAD = 3
NEW = 6
PAD_ID = 0
SEED = 7
#: mode -> (cache_implementation, left-padded prompts).
MODES = {"dynamic": (None, False), "padded": (None, True), "static": ("static", True)}
#: Where a failing generation's localization goes in the check's data (`data["localization"]`).
PART = "generate"

#: This process's reference generations by (checkpoint, dp): a control after its plain case reads the same.
_GENERATIONS = Recent(3, "transformers generations")


def prompts(dp: int, vocab: int, padded: bool) -> dict:
    """The global prompt batch: `max(2, dp)` rows rounded up to a multiple of `dp`; with `padded`, every second row
    left-padded."""
    rows = -(-max(2, dp) // dp) * dp
    ids = torch.randint(1, vocab, (rows, PROMPT), generator=torch.Generator().manual_seed(SEED))
    mask = torch.ones_like(ids)
    if padded:
        mask[1::2, :PAD] = 0
    return {"input_ids": ids.masked_fill(mask == 0, PAD_ID), "attention_mask": mask}


def arguments(mode: str, new: int = NEW) -> dict:
    cache, _ = MODES[mode]
    extra = {"cache_implementation": cache} if cache else {}
    return dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, num_beams=1, output_logits=True,
                return_dict_in_generate=True, pad_token_id=PAD_ID, **extra)


def generation(model, batch: dict, mode: str) -> rule.Generation:
    with torch.no_grad():
        out = model.generate(**batch, **arguments(mode))
    return rule.Generation(out.sequences.detach().cpu(), torch.stack([full(x).detach().cpu() for x in out.logits]))


def _with_task(body, batch: dict) -> dict:
    """The prompts as the case's task takes them: with an image (or a clip) per row for a vision-language (or an
    audio) model."""
    from paracheck.adapters.transformers import audio, images, tasks

    if body.task is tasks.AUDIO_TEXT:
        return audio.with_audio(batch, body.ref.config, SEED)
    return images.with_images(batch, body.ref.config, SEED) if body.task is tasks.IMAGE_TEXT else batch


def _reference(ref, batches: dict) -> dict:
    """Mode -> the single-process model's generation, or why that mode does not run on it."""
    found = {}
    for mode in MODES:
        try:
            found[mode] = generation(ref, batches[mode], mode)
        except Exception as exc:  # noqa: BLE001
            if not isinstance(exc, (ValueError, NotImplementedError, TypeError)) and not _raised_by_library(exc):
                raise  # the kit's own error, or the machine's: never a mode quietly left unchecked
            # what one process cannot do, no layout is held to (deepseek_v4's StaticCache raises KeyError on its
            # own layer type in transformers 5.25); said on the check
            found[mode] = f"the single-process model does not generate in mode {mode}: {type(exc).__name__}: {exc}"
    return found


def _raised_by_library(exc: BaseException) -> bool:
    """Whether the innermost frame that raised `exc` is transformers' own code (its package's folder: this
    adapter's path names transformers too)."""
    import transformers

    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    package = os.path.dirname(transformers.__file__) + os.sep
    return tb is not None and tb.tb_frame.f_code.co_filename.startswith(package)


def run(body) -> list[CheckResult]:
    """The pass for one case (`body`: the adapter's `_Body` after its checks)."""
    layout, ctx, tol = body.layout, body.ctx, body.tol
    vocab = body.ref.config.get_text_config().vocab_size
    batches = {mode: _with_task(body, prompts(layout.dp, vocab, padded)) for mode, (_, padded) in MODES.items()}
    with ctx.phase("generate_reference"):
        expected = _GENERATIONS.get((body.path, layout.dp), lambda: _reference(body.ref, batches))
    index, per = layout.dp_index(dist.get_rank()), rows_in(batches["dynamic"]) // layout.dp
    rows = slice(index * per, (index + 1) * per)
    # `share` cuts a tensor packing every row's image patches at its rows' images too
    mine = {mode: share(batch, index, layout.dp) for mode, batch in batches.items()}
    held, notes = {}, {}
    for mode in MODES:
        if isinstance(expected[mode], str):
            notes[mode] = expected[mode]
            continue
        actual, raised = ctx.attempt(lambda: generation(body.model, mine[mode], mode), CheckId.GENERATE)
        if raised is not None:
            return [CheckResult(CheckId.GENERATE, Status.FAIL, f"{mode}: generate raised {raised}",
                                failure=raised.failure)]
        held[mode] = rule.hold(actual, expected[mode].rows(rows.start, rows.stop), tol.atol, tol.rtol)
    result = rule.check(held, tol.atol, tol.rtol, notes)
    _localize(body, mine, held, result)
    return [result]


def _localize(body, mine: dict, held: dict, result: CheckResult) -> None:
    """Where parity.generate failed on any rank: every rank regenerates up to the first step that parted anywhere,
    in the first mode that failed anywhere, with hooks on both models; the first module beyond tolerance, and its
    decode step, become the check's `localization.generate`."""
    if not localize.enabled():
        return
    failed = torch.tensor([float(m in held and not held[m].ok) for m in MODES])
    steps = torch.tensor([float(held[m].first.step if m in held and held[m].first else NEW) for m in MODES])
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    dist.all_reduce(steps, op=dist.ReduceOp.MIN)
    if not failed.any():
        return
    chosen = int(failed.argmax())  # the first mode that failed anywhere, at the first step it parted anywhere
    mode, step = list(MODES)[chosen], min(int(steps[chosen]), NEW - 1)
    try:
        found = _trace(body, mine[mode], mode, step)
    except Exception as exc:  # a diagnosis that breaks must not turn a failing case into an error
        found = ForwardLocalization(error=rerun.raised(exc))
    if result.status == Status.FAIL:
        result.data.setdefault("localization", {})[PART] = found.to_json()


def _trace(body, mine: dict, mode: str, step: int) -> ForwardLocalization:
    from paracheck.adapters.transformers.localize import groups, pipeline_trace

    args = dict(arguments(mode, step + 1), output_logits=False, return_dict_in_generate=False)

    def generating(model):
        return model.generate(**mine, **args)

    ref_calls, _ = rerun.record(body.ref, generating)
    calls, _ = rerun.record(body.model, generating, local=localize.local_share)
    layout, tol = body.layout, body.tol
    if layout.pp > 1:
        found = pipeline_trace(body.model, calls, ref_calls, layout, tol.atol, tol.rtol)
    else:
        found = rerun.traced(calls, ref_calls, groups(layout), {"<root>"}, tol.atol, tol.rtol, PART)
    # Under pipeline stages only the stage holding the module recorded its call: every rank takes that stage's
    # answer (a collective every rank reaches, whatever it found).
    mine = decode_step(calls, found.first.module) if found.first else None
    return replace(found, pass_name=PART, mode=mode,
                   decode_step=next((s for s in localize.all_gather_object(mine) if s is not None), None))


def decode_step(calls: list, key: str) -> int | None:
    """The decode step (0: the prompt's forward) of the recorded call `key`: how many of the model's own calls (the
    root's) ended before it did."""
    call = next((c for c in calls if c.key == key), None)
    if call is None:
        return None
    return sum(1 for c in calls if c.name == "<root>" and c.end < call.end)
