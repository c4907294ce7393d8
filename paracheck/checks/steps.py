"""`parity.steps`: a run of optimizer steps held to the single-device run of the same steps, step by step.

Library-neutral. Each adapter takes the steps its own way (transformers' `Trainer`, a loop over torch's AdamW) and
records, after each step, the loss and every parameter gathered to full shape (`StepRecord`); this module compares
the two runs in order and names the first step, and the parameter, where they part.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from paracheck.checks.compare import BOUND_FACTOR, compare, compare_named
from paracheck.domain.records import CheckId, CheckResult, Status


@dataclass
class StepRecord:
    """What one optimizer step left: the step's loss (a 0-d tensor, or None where this rank has none, e.g. a
    pipeline stage before the last) and every parameter by name, whole (DTensors gathered), on the CPU."""
    loss: object
    params: dict = field(default_factory=dict)
    #: The gradient norm the step's clipping took (before clipping), where the trainer reports one. Reported, and
    #: named in a failing step's detail when it parts too, but not failing a step by itself: a norm sums the
    #: squares of every gradient, and its fp32 rounding (measured: 6.7e-6 relative, qwen3_moe fsdp2 left_pad) is
    #: within half the elementwise bound only; the parameters it scales are what the check holds.
    grad_norm: float | None = None


def compare_steps(actual: list[StepRecord], expected: list[StepRecord], atol: float, rtol: float,
                  own_error: list[dict] | None = None) -> CheckResult:
    """PASS when every step's loss and parameters match the reference's; else FAIL naming the first step (1-based)
    and what diverged there, with the worst error over the steps compared. `data` holds each step's figures.
    `own_error` (`reference_error`), where measured, is the reference's own rounding error per step and parameter:
    a failing parameter is held again to the tolerance plus twice it (`_excused`)."""
    if len(actual) != len(expected):
        return CheckResult(CheckId.STEPS, Status.FAIL, f"{len(actual)} steps recorded, the reference took "
                           f"{len(expected)}")
    worst_abs = worst_rel = 0.0
    per_step = []
    for step, (mine, ref) in enumerate(zip(actual, expected), start=1):
        problems, figures = _step_problems(mine, ref, atol, rtol, own_error[step - 1] if own_error else None)
        per_step.append(figures)
        worst_abs, worst_rel = max(worst_abs, figures["max_abs"]), max(worst_rel, figures["max_rel"])
        if problems:
            return CheckResult(CheckId.STEPS, Status.FAIL, f"step {step} of {len(expected)}: " + "; ".join(problems),
                               worst_abs, worst_rel, atol, rtol, data={"steps": per_step, "first_step": step})
    return CheckResult(CheckId.STEPS, Status.PASS, "", worst_abs, worst_rel, atol, rtol, data={"steps": per_step})


#: How far, in tolerances (atol), the reference's own error may widen one element's bound: beyond it the float32 and
#: float64 steps took different paths there (a top-k near a tie, a clip at the edge), the reference is unstable at
#: that element, and a parallel step that parts there is not excused.
EXCUSE_ATOLS = 10


def reference_error(expected: list[StepRecord], exact: list[StepRecord]) -> list[dict]:
    """Per step, each parameter's distance, element by element, between the reference's steps and the same steps in
    a wider dtype (`exact`, float64): the reference's own rounding error, which Adam can amplify far past one ulp (an
    element whose gradient is at or below `eps` moves by up to lr / eps times its gradient's rounding). Raises
    ValueError where the two runs took a different number of steps."""
    if len(expected) != len(exact):
        raise ValueError(f"the wide run took {len(exact)} steps, the reference {len(expected)}")
    return [{name: (ref.params[name].double() - wide.params[name].double()).abs()
             for name in ref.params if name in wide.params and wide.params[name].shape == ref.params[name].shape}
            for ref, wide in zip(expected, exact)]


def _step_problems(mine: StepRecord, ref: StepRecord, atol: float, rtol: float,
                   error: dict | None = None) -> tuple[list[str], dict]:
    """(what parted at one step, its figures): the loss, the gradient norm (named beside another problem only), the
    parameters by name, each excused within the reference's own `error` where one is given (`_excused`)."""
    problems: list[str] = []
    figures = {"max_abs": 0.0, "max_rel": 0.0, "worst": None}
    if mine.loss is not None:
        loss = compare(CheckId.STEPS, mine.loss, ref.loss, atol, rtol, "loss")
        figures.update(loss=float(mine.loss), reference_loss=float(ref.loss))
        _worse(figures, loss, "loss")
        if loss.status == Status.FAIL:
            problems.append(f"loss {float(mine.loss):.6g} != reference {float(ref.loss):.6g}")
    norm_note = _norm_note(mine, ref, figures, atol, rtol)
    held = compare_named(CheckId.STEPS, mine.params, ref.params, atol, rtol)
    if error is not None:
        held.failing, excused = _excused(held.failing, mine, ref, atol, rtol, error)
        if excused:
            figures["excused"] = excused
    if held.missing or held.extra:
        problems.append(f"parameters missing {held.missing[:3]}, unexpected {held.extra[:3]}")
    if held.worst is not None and held.max_abs >= figures["max_abs"]:
        figures["max_abs"], figures["worst"] = held.max_abs, held.worst
    figures["max_rel"] = max(figures["max_rel"], held.max_rel)
    if held.failing:
        size, name, detail = held.failing[0]
        problems.append(f"{len(held.failing)} parameter(s) differ, worst {name} (max_abs {size:.2e})"
                        if size and size != float("inf") else f"{name}: {detail}")
        figures["failing"] = [n for _, n, _ in held.failing[:10]]
    return ([norm_note] + problems if problems and norm_note else problems), figures


def _excused(failing: list, mine: StepRecord, ref: StepRecord, atol: float, rtol: float,
             error: dict) -> tuple[list, dict]:
    """(the failing parameters still failing, those excused with their figures): a parameter is excused where every
    element is within the tolerance plus `BOUND_FACTOR` (2) times the reference's own error at that element (`error`:
    name -> its distance from the wide run, elementwise, or one number for all), an allowance taken only where it
    is finite and at most `EXCUSE_ATOLS` tolerances. Two float32 runs each that far from the exact steps may part
    from each other by twice it (the triangle inequality; `checks.compare` bounds reduced precision alike)."""
    kept, excused = [], {}
    for item in failing:
        _, name, _ = item
        if name not in error or mine.params[name].shape != ref.params[name].shape:
            kept.append(item)
            continue
        allowance = BOUND_FACTOR * torch.as_tensor(error[name], dtype=torch.float64)
        allowance = torch.where(torch.isfinite(allowance) & (allowance <= EXCUSE_ATOLS * atol), allowance, 0.0)
        expected = ref.params[name].double()
        diff = (mine.params[name].double() - expected).abs()
        if bool(torch.isfinite(diff).all()) and bool((diff <= atol + rtol * expected.abs() + allowance).all()):
            excused[name] = {"max_abs": float(diff.max()), "reference_error": float(torch.as_tensor(error[name]).max())}
        else:
            kept.append(item)
    return kept, excused


def _norm_note(mine: StepRecord, ref: StepRecord, figures: dict, atol: float, rtol: float) -> str | None:
    """The step's gradient norms into `figures`; a line naming them where they part beyond the bound."""
    if mine.grad_norm is None or ref.grad_norm is None:
        return None
    figures.update(grad_norm=mine.grad_norm, reference_grad_norm=ref.grad_norm)
    if abs(mine.grad_norm - ref.grad_norm) <= atol + rtol * abs(ref.grad_norm):
        return None
    return f"grad_norm {mine.grad_norm:.6g} != reference {ref.grad_norm:.6g}"


def _worse(figures: dict, result: CheckResult, name: str) -> None:
    if (result.max_abs or 0.0) >= figures["max_abs"]:
        figures["max_abs"], figures["worst"] = result.max_abs or 0.0, name
    figures["max_rel"] = max(figures["max_rel"], result.max_rel or 0.0)
