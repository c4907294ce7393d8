"""Where a failing `parity.steps` first leaves the reference: the first step that parted, and in it the module.

After the steps, every rank learns (one all-reduce) the first step any rank's records parted at (`k`). Both
models are put back to where step k began, each from the reference's parameters after step k - 1 (the parallel
run's agreed with them to the tolerance, or step k - 1 would have parted): the parallel model's shards sliced
from them as its placements name (`distribute_tensor(..., src_data_rank=None)`, which moves nothing), the single-
device twin loaded whole. Step k's forward is then rerun with hooks on both, on this rank's shard of the step's
batch, and held module by module (`localize.after_checks`' reading of the plan); then its backward, every
gradient against the twin's on the global batch (`body.gradient_check`). Where the difference arises:

- `forward`: a module's output at step k differs (a bias counted tp times, zero at initialisation, shows once
  a step has moved it);
- `gradients`: the forward agrees and a gradient differs (the gradient table's origin);
- `update`: the forward and every gradient agree, so the update parts them (the clip, the optimizer, or what
  runs after them), first in the parameter the step's records name.

The finding is the check's `data["localization"]["steps"]` (the case's `localization.steps`), and one line of
it ends the check's detail. The rerun leaves both models as it found them only in what the checks read: it
runs last, and the case's models are dropped after it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from paracheck.adapters.torch import grads as gradients, localize, names
from paracheck.adapters.torch.batches import call, shard
from paracheck.checks import localize as tracing, rerun
from paracheck.checks.shards import full
from paracheck.domain.localization import ForwardLocalization, GradsLocalization, StepsLocalization
from paracheck.domain.records import CheckResult, Status
from paracheck.results.localization import steps_line

#: What an all-reduce MIN reads as "this rank's steps all agreed".
NONE = 1 << 30


def first_step(result: CheckResult, device) -> int | None:
    """The first step (1-based) any rank's records parted at, agreed in one all-reduce; None when none did."""
    mine = result.data.get("first_step") if result.status == Status.FAIL else None
    flag = torch.tensor([mine or NONE], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return None if int(flag) == NONE else int(flag)


def restore(model, state: dict, device) -> None:
    """`model`'s parameters set to `state` (clean name -> whole tensor), each DTensor to its own slice of it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, param in names.parameters(model).items():
            if name not in state:
                continue
            whole = state[name].to(device, param.dtype)
            if isinstance(param, DTensor):
                whole = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(whole.to_local())
            else:
                param.copy_(whole)
            param.grad = None


def rerun_step(body, step: int, batches: list, expected, losses) -> StepsLocalization:
    """Step `step` (1-based) rerun from where it began on both models: the finding (see the module docstring).
    `losses`: (the reference's loss, the parallel one's), as `steps` builds them."""
    before = body.ref_params if step == 1 else expected.records[step - 2].params
    restore(body.model, before, body.device)
    restore(body.twin, before, body.device)
    layout = body.layout
    mine = shard(batches[step - 1], layout.dp_index(body.rank), layout.dp_degree)
    with localize.eager():
        ref_calls, _ = rerun.record(body.twin, lambda m: call(m, mine), names=names.hooked(body.twin))
        declared = localize.placements(body.model)
        calls, _ = rerun.record(body.model, lambda m: call(m, mine), True, local=full, names=names.hooked(body.model))
        forward = rerun.traced(calls, ref_calls, localize.groups(body.mesh, layout, declared), localize.WHOLE,
                               body.atol, body.rtol, "training", declared=declared)
    reference_loss, parallel_loss = losses
    reference_loss(body.twin, step - 1)[0].backward()
    ref_grads = {n: (p.grad.detach().clone() if p.grad is not None else None)
                 for n, p in names.parameters(body.twin).items()}
    parallel_loss(body.model, step - 1)[0].backward()
    grads = gradients.check(names.parameters(body.model), ref_grads, layout, body.atol, body.rtol)
    table = GradsLocalization.from_json(grads.data["localization"]["grads"]) if grads.status == Status.FAIL else None
    return StepsLocalization(step, len(batches), forward, table, *where(forward, table))


def where(forward: ForwardLocalization, grads: GradsLocalization | None) -> tuple[str, str | None]:
    """`where` the step parts ("forward", "gradients", "update") and `origin`, the module or parameter (pure)."""
    if forward.first:
        return "forward", forward.origin or forward.first.module
    if grads is not None:
        return "gradients", grads.origin
    return "update", None


def attach(body, result: CheckResult, batches: list, expected, losses) -> None:
    """Localize a failing `parity.steps` on every rank (they decide alike); a diagnosis that raises is recorded,
    never turns the failure into an error."""
    if not tracing.enabled():
        return
    step = first_step(result, body.device)
    if step is None:
        return
    try:
        found = rerun_step(body, step, batches, expected, losses)
    except Exception as exc:  # the check failed either way; the diagnosis must not hide it
        found = StepsLocalization(step, error=rerun.raised(exc))
    result.data.setdefault("localization", {})["steps"] = found.to_json()
    if result.status == Status.FAIL and not found.error:
        failing = (result.data.get("steps") or [{}])[-1].get("failing")
        result.detail += f"; {steps_line(found, failing)}"
