"""The optimizer-step loop of `parity.steps`: torch's AdamW and gradient clipping, run alike on a parallel model and
on its single-device twin, each step's loss and parameters (gathered whole) recorded as `steps.StepRecord`s.

Library-neutral. An adapter whose library has no trainer hands it the model, the loss of one step (fresh inputs
each step, its own loss rule) and, where its library leaves a gradient reduction to the user, what a user adds
after the backward (`after_backward`). The reference run fixes the loop's settings from its first gradient
(`Settings`), and the parallel run takes the same ones. A negative control plants its bug through `Hooks`; the
bugs themselves are here (`clip_local_norm`, `decay_replicated_again`) so that every adapter's controls share them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from paracheck.checks.shards import full
from paracheck.checks.steps import StepRecord
from paracheck.checks.wholes import wholes
from paracheck.domain.records import CheckId, CheckResult, Status

LR = 1e-2
WEIGHT_DECAY = 0.1
#: The max norm is this fraction of the reference's first gradient norm, so the clip acts on the first step.
CLIP_FRACTION = 0.5


@dataclass(frozen=True)
class Settings:
    """What both runs share. `max_norm`: `CLIP_FRACTION` of the reference's first total gradient norm, so the clip
    acts (the norms each run records say on which steps). `eps`: AdamW's, at the root mean square of that clipped
    gradient, where torch's default (1e-8) would make the update blind to the gradient's scale (m / sqrt(v)): a clip
    by the wrong norm scales the gradient, and only an eps of the gradient's own size lets that show in a step."""
    max_norm: float
    eps: float

    def to_json(self) -> dict:
        return {"lr": LR, "weight_decay": WEIGHT_DECAY, "max_norm": self.max_norm, "eps": self.eps}


def _is_dtensor(tensor) -> bool:
    return hasattr(tensor, "full_tensor")


def _kind(tensor):
    """What torch clips together: plain tensors (None), or DTensors of one mesh (that mesh's id)."""
    return id(tensor.device_mesh) if _is_dtensor(tensor) else None


def _by_kind(params: list) -> list[list]:
    kinds: dict = {}
    for param in params:
        kinds.setdefault(_kind(param.grad), []).append(param)
    return list(kinds.values())


def total_norm(params: list, local: bool = False, groups: list | None = None) -> torch.Tensor:
    """The 2-norm of every gradient of `params` together (torch's `get_total_norm` per kind, combined); `local`:
    of this rank's own shards only (the bug `clip_local_norm` plants). `groups`: `params` by kind, if known."""
    from torch.nn.utils import get_total_norm

    if local:
        return get_total_norm([p.grad.to_local() if _is_dtensor(p.grad) else p.grad for p in params])
    groups = _by_kind(params) if groups is None else groups
    return get_total_norm([full(get_total_norm([p.grad for p in group])).reshape(()) for group in groups])


def clip(params: list, max_norm: float) -> tuple[float, str]:
    """Clip the gradients of `params` to `max_norm` by their total norm; (the norm before clipping, how).

    torch's own `clip_grad_norm_` where it takes the gradients: all plain, or DTensors of one mesh (every layout of
    the torch example, FSDP + TP included, and diffusers under CP). A mix of DTensors and plain tensors (a diffusers
    TP model: its planned parameters are DTensors, the rest plain) it refuses (`aten._foreach_norm.Scalar got mixed
    torch.Tensor and DTensor`), so there, and for DTensors of several meshes, the norm is taken per kind with its
    `get_total_norm`, made whole and combined, and every kind clipped by it with its `clip_grads_with_norm_`."""
    from torch.nn.utils import clip_grad_norm_, clip_grads_with_norm_

    params = [p for p in params if p.grad is not None]
    groups = _by_kind(params)
    if len(groups) <= 1:
        return float(full(clip_grad_norm_(params, max_norm))), "clip_grad_norm_"
    norm = total_norm(params, groups=groups)
    for group in groups:
        clip_grads_with_norm_(group, max_norm, norm)
    return float(norm), "get_total_norm + clip_grads_with_norm_ per kind (clip_grad_norm_ refuses a mix)"


def clip_local_norm(params: list, max_norm: float) -> tuple[float, str]:
    """A bug: the clip's norm taken over this rank's own shards only, so each rank scales by a factor of its own."""
    from torch.nn.utils import clip_grads_with_norm_

    params = [p for p in params if p.grad is not None]
    norm = total_norm(params, local=True)
    for group in _by_kind(params):
        clip_grads_with_norm_(group, max_norm, norm)
    return float(norm), "the local shards' norm (planted)"


def replicated(param) -> bool:
    """Whether every rank holds the whole of `param`: a plain tensor, or a DTensor replicated on every mesh dim."""
    return not _is_dtensor(param) or all(p.is_replicate() for p in param.placements)


def decay_replicated_again(model, optimizer) -> None:
    """A bug: AdamW's decoupled weight decay applied a second time to every parameter replicated on every rank (an
    optimizer wrapper that decays the parameters it does not shard itself, after the optimizer did)."""
    with torch.no_grad():
        for group in optimizer.param_groups:
            for param in group["params"]:
                if replicated(param):
                    (param.to_local() if _is_dtensor(param) else param).mul_(1 - group["lr"] * group["weight_decay"])


@dataclass(frozen=True)
class Hooks:
    """Where a negative control plants its bug. `clip(params, max_norm) -> (norm before clipping, how)`;
    `after_step(model, optimizer)` runs after each `optimizer.step()`."""
    clip: Callable = clip
    after_step: Callable | None = None


#: The loop as it should run.
PLAIN = Hooks()


@dataclass
class Trace:
    """One run of the loop: a record per step, the total norm before each clip, the settings, how it clipped."""
    records: list[StepRecord] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    settings: Settings | None = None
    clipped_by: str = ""


def whole_params(model) -> dict:
    """Every parameter by name, whole (DTensors gathered as `full_tensor()` gives them, one collective per mesh and
    dtype: `checks.wholes`, in `named_parameters` order, which every rank shares), detached, on the CPU."""
    return {name: whole.clone() for name, whole in wholes(dict(model.named_parameters())).items()}


def train(model, step_loss: Callable, steps: int, settings: Settings | None = None, hooks: Hooks = PLAIN,
          after_backward: Callable | None = None, gather: Callable = whole_params) -> Trace:
    """`steps` optimizer steps on `model`. `step_loss(model, step) -> (loss to differentiate, loss to record)`, the
    step's forward on fresh inputs (`step` counts from 0); `after_backward(model)`: the gradient reductions the
    library leaves to its user; `settings`: the reference run's (None on the reference itself: measured at its
    first step). Gradients present before the loop are dropped."""
    params = [p for p in model.parameters() if p.requires_grad]
    trace, optimizer = Trace(settings=settings), None
    for step in range(steps):
        for param in params:
            param.grad = None
        loss, recorded = step_loss(model, step)
        loss.backward()
        if after_backward is not None:
            after_backward(model)
        if trace.settings is None:
            trace.settings = measured(params)
        if optimizer is None:
            optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, eps=trace.settings.eps)
        norm, trace.clipped_by = hooks.clip(params, trace.settings.max_norm)
        optimizer.step()
        if hooks.after_step is not None:
            hooks.after_step(model, optimizer)
        trace.norms.append(norm)
        trace.records.append(StepRecord(None if recorded is None else recorded.detach().cpu(), gather(model)))
    for param in params:
        param.grad = None
    return trace


def agreed(reason: str | None, device) -> str | None:
    """Every rank's answer to whether the steps run, agreed in one all-reduce (on `device`, the backend's): a rank
    that cannot take them stops them everywhere (a rank skipping while another steps would leave its peers in a
    collective)."""
    flag = torch.tensor([0 if reason is None else 1], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not int(flag):
        return None
    return reason or "another rank cannot take the steps (its parity.grads or training pass failed)"


def raised_result(raised) -> CheckResult:
    """`parity.steps` where the parallel run's loop raised (`raised`: the skeleton's `Raised`, typed, with this
    rank's traceback kept)."""
    return CheckResult(CheckId.STEPS, Status.FAIL, f"the optimizer steps raised {raised}", failure=raised.failure)


def measured(params: list) -> Settings:
    """The settings from a first gradient (see `Settings`)."""
    with_grad = [p for p in params if p.grad is not None]
    norm = float(total_norm(with_grad))
    count = sum(p.grad.numel() for p in with_grad)
    max_norm = CLIP_FRACTION * norm
    return Settings(max_norm, max_norm / math.sqrt(max(count, 1)))


def figures(actual: Trace, expected: Trace) -> dict:
    """What `parity.steps`' data says about the loop: its settings, each run's norms, whether each step clipped."""
    max_norm = expected.settings.max_norm if expected.settings else None
    return {"settings": expected.settings.to_json() if expected.settings else {}, "clipped_by": actual.clipped_by,
            "norms": actual.norms, "reference_norms": expected.norms,
            "clipped": [max_norm is not None and n > max_norm for n in expected.norms]}
