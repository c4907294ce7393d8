"""`parity.steps`: a run of optimizer steps held to the single-device run of the same steps, step by step.

Library-neutral. Each adapter takes the steps its own way (transformers' `Trainer`, a loop over torch's AdamW) and
records, after each step, the loss and every parameter gathered to full shape (`StepRecord`); this module compares
the two runs in order and names the first step, and the parameter, where they part.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from paracheck.checks.compare import BOUND_FACTOR, compare, compare_named
from paracheck.domain.records import BEYOND_PRECISION, CheckId, CheckResult, Status


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
                  own_error: list[dict] | None = None, ceiling: float | None = None) -> CheckResult:
    """PASS when every step's loss and parameters match the reference's; else FAIL naming the first step (1-based)
    and what diverged there, with the worst error over the steps compared. `data` holds each step's figures.
    `own_error` (`reference_error`), where measured, is the reference's own rounding error per step and parameter:
    a failing parameter is held again against it (`against_own_error`, "beyond" at most `ceiling`), and a pass where
    one stood only as "beyond" says so, naming the first (`data["beyond_step"]`): there the reference is too
    imprecise for the tolerance."""
    if len(actual) != len(expected):
        return CheckResult(CheckId.STEPS, Status.FAIL, f"{len(actual)} steps recorded, the reference took "
                           f"{len(expected)}")
    worst_abs = worst_rel = 0.0
    per_step = []
    for step, (mine, ref) in enumerate(zip(actual, expected), start=1):
        problems, figures = _step_problems(mine, ref, atol, rtol, own_error[step - 1] if own_error else None,
                                           ceiling)
        per_step.append(figures)
        worst_abs, worst_rel = max(worst_abs, figures["max_abs"]), max(worst_rel, figures["max_rel"])
        if problems:
            return CheckResult(CheckId.STEPS, Status.FAIL, f"step {step} of {len(expected)}: " + "; ".join(problems),
                               worst_abs, worst_rel, atol, rtol, data={"steps": per_step, "first_step": step})
    result = CheckResult(CheckId.STEPS, Status.PASS, _own_error_detail(per_step), worst_abs, worst_rel, atol, rtol,
                         data={"steps": per_step})
    beyond = next((s for s, figures in enumerate(per_step, 1) if figures.get("beyond")), None)
    if beyond is not None:
        result.data.update({"beyond_step": beyond, BEYOND_PRECISION: True})
    return result


#: How far, in tolerances (atol), the reference's own error may widen a bound as an excuse (`against_own_error`).
#: Past it the float32 reference is itself that far from the exact steps (Adam amplifying its rounding over the
#: steps, or a top-k near a tie taken another way), too imprecise for the tolerance to judge the run.
EXCUSE_ATOLS = 10
#: Where the reference is that imprecise, how far, in tolerances, a parallel run may still part from it and pass, as
#: "beyond" (the check's detail says so); an adapter that knows its step's size lowers it (`ceiling`): the
#: transformers adapter to a tenth of an Adam step, so no wrong step ever passes (1e-3 at its lr 1e-2: at fp32's
#: CPU atol 1e-5 both are 1e-3, at CUDA's 1e-4 the lr's rules).
BEYOND_ATOLS = 100


def reference_error(expected: list[StepRecord], exact: list[StepRecord]) -> list[dict]:
    """Per step, each parameter's distance from the same steps in a wider dtype (`exact`, float64), as its largest
    over each row (the last dimension; a vector element by element): the reference's own rounding error, which Adam can
    amplify far past one ulp (an element whose gradient is at or below `eps` moves by up to lr / eps times its
    gradient's rounding). Per row, not per element: two runs' rounding at one element are two draws whose ratio is
    heavy-tailed (measured, gemma4_text dpr4 step 3: 1.37e-5 from the reference on an lm_head element where the
    reference's own error is 8.8e-7; 2 or 3 such elements in each of 9 parameters, none once each row's largest is
    taken), while a row (an embedding's token, a projection's output) shares its gradient's fate. Raises
    ValueError where the two runs took a different number of steps."""
    if len(expected) != len(exact):
        raise ValueError(f"the wide run took {len(exact)} steps, the reference {len(expected)}")
    return [{name: _rows_max((ref.params[name].double() - wide.params[name].double()).abs())
             for name in ref.params if name in wide.params and wide.params[name].shape == ref.params[name].shape
             and ref.params[name].numel()}
            for ref, wide in zip(expected, exact)]


def _rows_max(distance: torch.Tensor) -> torch.Tensor:
    """`distance`'s largest over each row (keeping the dimension, so it broadcasts back); a vector's (a bias, a norm's
    weight, whose elements share no gradient) element by element; NaN wherever a row holds one."""
    if distance.dim() < 2:
        return distance
    return torch.where(distance.isnan().any(-1, keepdim=True), math.nan, distance.amax(-1, keepdim=True))


def against_own_error(diff: torch.Tensor, bound: torch.Tensor, error, atol: float,
                      ceiling: float | None = None) -> str | None:
    """How values that part from the reference by `diff` (past their tolerance `bound`) stand against the
    reference's own `error` there (a number, or a tensor that broadcasts to `diff`): "excused" within the bound plus
    `BOUND_FACTOR` (2) times it, that allowance at most `EXCUSE_ATOLS` atol (two float32 runs each that far from the
    exact steps may part by twice it, the triangle inequality; `checks.compare` bounds reduced precision alike);
    "beyond" where only an allowance past that cap, up to `beyond_limit` (`BEYOND_ATOLS` atol, or `ceiling` where
    lower), holds them (the reference too imprecise there to judge them at the tolerance); else None. A NaN or
    infinite own error allows nothing."""
    allowance = BOUND_FACTOR * torch.as_tensor(error, dtype=torch.float64)
    allowance = torch.where(torch.isfinite(allowance), allowance, 0.0)
    if not bool(torch.isfinite(diff).all()):
        return None
    if bool((diff <= bound + allowance.clamp(max=EXCUSE_ATOLS * atol)).all()):
        return "excused"
    if bool((diff <= bound + allowance.clamp(max=beyond_limit(atol, ceiling))).all()):
        return "beyond"
    return None


def beyond_limit(atol: float, ceiling: float | None = None) -> float:
    """The most a "beyond" allowance may be: `BEYOND_ATOLS` atol, or `ceiling` where lower."""
    return BEYOND_ATOLS * atol if ceiling is None else min(BEYOND_ATOLS * atol, ceiling)


def widest_excuse(records: list[StepRecord], atol: float) -> list[dict]:
    """An own error for every parameter of `records` at which `against_own_error` excuses the most it ever does: what
    a failed comparison is held to, to ask whether measuring the reference's own error could turn it."""
    return [dict.fromkeys(r.params, EXCUSE_ATOLS * atol / BOUND_FACTOR) for r in records]


def _step_problems(mine: StepRecord, ref: StepRecord, atol: float, rtol: float, error: dict | None = None,
                   ceiling: float | None = None) -> tuple[list[str], dict]:
    """(what parted at one step, its figures): the loss, the gradient norm (named beside another problem only), the
    parameters by name, each held against the reference's own `error` where one is given (`_excused`)."""
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
        held.failing, standing = _excused(held.failing, mine, ref, atol, rtol, error, ceiling)
        figures.update({k: v for k, v in standing.items() if v})
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


def _excused(failing: list, mine: StepRecord, ref: StepRecord, atol: float, rtol: float, error: dict,
             ceiling: float | None = None) -> tuple[list, dict]:
    """(the failing parameters still failing, {"excused": ..., "beyond": ...}: the others by how they stand against
    the reference's own error, `error`: name -> its distance from the wide run, `reference_error`'s, or one number),
    each with its figures."""
    kept, standing = [], {"excused": {}, "beyond": {}}
    for item in failing:
        _, name, _ = item
        if name not in error or mine.params[name].shape != ref.params[name].shape:
            kept.append(item)
            continue
        expected = ref.params[name].double()
        diff = (mine.params[name].double() - expected).abs()
        how = against_own_error(diff, atol + rtol * expected.abs(), error[name], atol, ceiling)
        if how is None:
            kept.append(item)
        else:
            standing[how][name] = {"max_abs": float(diff.max()),
                                   "reference_error": float(torch.as_tensor(error[name]).max()),
                                   "limit": beyond_limit(atol, ceiling)}
    return kept, standing


def _own_error_detail(steps: list[dict]) -> str:
    """A pass's words for what the reference's own error let through: the first step where only an allowance past
    the excuse held a parameter ("beyond"), else the parameter excused by most, else ""."""
    beyond = next(((s, step["beyond"]) for s, step in enumerate(steps, 1) if step.get("beyond")), None)
    if beyond is not None:
        s, (n, f) = beyond[0], max(beyond[1].items(), key=lambda kv: kv[1]["max_abs"])
        return (f"at step {s} of {len(steps)} the float32 reference is itself up to {f['reference_error']:.2e} from "
                f"its float64 steps on {n}, past what the tolerance can judge ({EXCUSE_ATOLS} atol); the parallel "
                f"run parts from it by {f['max_abs']:.2e}, within the tolerance plus twice that (at most "
                f"{f['limit']:.0e}); each step is held to its own measure")
    excused = [(s, n, f) for s, step in enumerate(steps, 1) for n, f in step.get("excused", {}).items()]
    if not excused:
        return ""
    s, n, f = max(excused, key=lambda t: t[2]["max_abs"])
    return (f"within the reference's own rounding error: {n} parts by {f['max_abs']:.2e} at step {s}, where the "
            f"float32 reference is up to {f['reference_error']:.2e} from its float64 steps (each row held to the "
            "tolerance plus twice its own)")


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
