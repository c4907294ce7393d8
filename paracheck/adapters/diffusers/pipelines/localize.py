"""A failing pipeline case localized: the first step whose latents went beyond tolerance on any rank, and there the
module where the parallel transformer first differs from the reference's.

Every rank learns in one all-reduce whether `parity.pipeline` failed anywhere, whether a rank's pipeline raised
(then nothing is rerun: its peers may be inside a collective), and the first failing step (the smallest over the
ranks). Each rank then takes the first transformer call of that step as its own pipeline made it (the whole inputs,
recorded before diffusers' split), reruns it on the parallel transformer with hooks on every module, runs the
reference transformer on the same inputs, and the traces are gathered and compared as a single call's are
(`adapters.diffusers.localize`). The step goes into the finding (`step`), and the finding into the check's
`data["localization"]["forward"]`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from paracheck.adapters.diffusers import localize as model_localize
from paracheck.checks import localize, rerun
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
        found = step_localization(body, first)
    except Exception as exc:  # a diagnosis that breaks must not turn a failing case into an error
        found = {"error": f"localization raised {type(exc).__name__}: {exc}"}
    if check is not None:
        check.data.setdefault("localization", {})["forward"] = found


def step_localization(body, step: int) -> dict:
    """Step `step`'s first transformer call rerun on both transformers with hooks, traced and compared (collective)."""
    args, kwargs = next((a, k) for s, a, k in body.recording.calls if s == step - 1)
    ctx = body.checks

    def call(model):
        return model(*args, **dict(kwargs, return_dict=False))[0]

    ref_calls, _ = rerun.record(ctx.reference, call)
    calls, _ = rerun.record(ctx.model, call, local=localize.local_share)
    found = rerun.traced(calls, ref_calls, model_localize.groups(ctx, ref_calls), model_localize.whole(ctx.model),
                         ctx.atol, ctx.rtol, f"step {step}")
    found["step"] = step
    return found
