"""A failing pipeline case localized: the first step whose latents went beyond tolerance on any rank, the first step
whose transformer call already differs from the reference's, and there the module where it first differs.

Every rank learns in one all-reduce whether `parity.pipeline` failed anywhere, whether a rank's pipeline raised
(then nothing is rerun: its peers may be inside a collective), and the first failing step (the smallest over the
ranks). The latents can stay within tolerance for steps after a bug began (an error the loop feeds back grows
from far below the bound), so the steps up to that one are taken in order: each step's first transformer call, as
the rank's own pipeline made it (the whole inputs, recorded before diffusers' split), is rerun on the parallel
transformer with hooks on every module, the reference transformer runs the same inputs, and the traces are
gathered and compared as a single call's are (`adapters.diffusers.localize`). The first step where a module is
beyond tolerance on any rank is the step the bug shows in (`step`; `beyond_from`: the latents' first failing step);
its trace is the finding, in the check's `data["localization"]["forward"]`.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from paracheck.adapters.diffusers import localize as model_localize
from paracheck.adapters.diffusers.pipelines import loop
from paracheck.checks import localize, rerun
from paracheck.domain.localization import ForwardLocalization
from paracheck.domain.records import CheckId, Status

#: A first step no rank failed at: larger than any run's steps.
_NONE = 1e9


def after_checks(body, checks: list) -> None:
    if not localize.enabled():
        return
    check = next((c for c in checks if c.id == CheckId.PIPELINE), None)
    failed = check is not None and check.status == Status.FAIL
    step = (check.data or {}).get("first_step") if failed else None
    flags = torch.tensor([float(failed), float(body.raised is not None), -float(step or _NONE)])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    any_failed, any_raised, first = bool(flags[0] > 0), bool(flags[1] > 0), int(-flags[2])
    if not any_failed or any_raised or first >= _NONE:
        return  # nothing failed, a pipeline raised, or only the decoded output differs (the VAE runs whole)
    try:
        found = first_diverging(body, first)
    except Exception as exc:  # a diagnosis that breaks must not turn a failing case into an error
        found = ForwardLocalization(error=rerun.raised(exc))
    if check is not None:
        check.data.setdefault("localization", {})["forward"] = found.to_json()


def first_diverging(body, beyond: int) -> ForwardLocalization:
    """Steps 1 to `beyond` in order, each step's first call traced, until one differs beyond tolerance at some module
    on any rank (every rank decides alike: one all-reduce a step); that step's trace, or the last one's."""
    copies = ({}, {})  # the state objects each transformer holds over the replayed steps (`loop.owned`)
    for step in range(1, beyond + 1):
        found = step_localization(body, step, copies)
        differs = torch.tensor([float(found.first is not None)])
        dist.all_reduce(differs, op=dist.ReduceOp.MAX)
        if differs.item() > 0 or step == beyond:
            return replace(found, beyond_from=beyond)
    return ForwardLocalization()


def step_localization(body, step: int, copies: tuple = ({}, {})) -> ForwardLocalization:
    """Step `step`'s first transformer call rerun on both transformers with hooks, traced and compared (collective).
    `copies`: the reference's and the parallel transformer's own state objects, kept from the steps replayed before."""
    import contextlib

    args, kwargs, context = next((a, k, c) for s, a, k, c in body.recording.calls if s == step - 1)
    ctx = body.checks

    def call_with(held: dict):
        def call(model):
            entered = model.cache_context(context[0], **context[1]) if context else contextlib.nullcontext()
            with entered:
                return model(*args, **dict(loop.owned(kwargs, held), return_dict=False))[0]
        return call

    ref_calls, _ = rerun.record(ctx.reference, call_with(copies[0]))
    calls, _ = rerun.record(ctx.model, call_with(copies[1]), local=localize.local_share)
    found = rerun.traced(calls, ref_calls, model_localize.groups(ctx, ref_calls), model_localize.whole(ctx.model),
                         ctx.atol, ctx.rtol, f"step {step}")
    return replace(found, step=step)
