"""The comparison rules: tolerances by dtype and device, and how a parallel result is held to a reference.

Library-neutral: every adapter's numerical checks (outputs, logits, losses, gradients) compare through here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from paracheck.domain.records import CheckId, CheckResult, Status

# (atol, rtol) by dtype and device type. fp32 on CPU agrees to ~1e-7 on the fixtures (measured), so
# these leave two orders of magnitude of headroom and still fail a 3e-2 shift by three.
_TOLERANCES = {
    (torch.float32, "cpu"): (1e-5, 1e-5),
    (torch.float32, "cuda"): (1e-4, 1e-4),
    (torch.float32, "neuron"): (2e-4, 2e-4),
    (torch.bfloat16, None): (2e-2, 2e-2),
    (torch.float16, None): (2e-3, 2e-3),
}


def tolerance(dtype: torch.dtype, device_type: str) -> tuple[float, float]:
    for key in ((dtype, device_type), (dtype, None)):
        if key in _TOLERANCES:
            return _TOLERANCES[key]
    return _TOLERANCES[(torch.float32, "cuda")]


#: Reduced precision: the parallel result's error against the fp32 reference may be at most this many
#: times the single-device run's own error at that dtype, plus a floor x max |fp32 reference|: FLOOR for
#: outputs; for gradients one unit of the dtype's precision, since a parallel gradient is summed over
#: ranks in another order than the single-device one (measured: a bf16 bias gradient 6e-3 off, clean).
BOUND_FACTOR = 2.0
FLOOR = 1e-3


def compare(check_id: CheckId, actual, expected, atol: float, rtol: float, what: str = "output",
            expected32=None, floor: float = FLOOR) -> CheckResult:
    """Shape, finiteness, then the tolerance rule; all on the CPU in float64.

    fp32: |a - b| <= atol + rtol * |b| elementwise, max_rel relative to max |b|. Reduced precision
    (`expected32` given): max |a - ref32| <= BOUND_FACTOR * max |b - ref32| + FLOOR * max |ref32|, where b is
    the single-device run at the same dtype; both errors are reported."""
    if tuple(actual.shape) != tuple(expected.shape):
        return CheckResult(check_id, Status.FAIL, f"{what} shape {tuple(actual.shape)} != reference {tuple(expected.shape)}")
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    if not torch.isfinite(actual).all():
        return CheckResult(check_id, Status.FAIL, f"{what} has non-finite values", atol=atol, rtol=rtol)
    if expected32 is not None:
        return _compare_reduced(check_id, actual, expected, expected32.detach().double().cpu(), what, floor)
    diff = (actual - expected).abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    max_rel = max_abs / max(float(expected.abs().max()) if expected.numel() else 0.0, 1e-12)
    ok = bool((diff <= atol + rtol * expected.abs()).all())
    detail = "" if ok else f"{what} differs from the single-device reference"
    return CheckResult(check_id, Status.PASS if ok else Status.FAIL, detail, max_abs, max_rel, atol, rtol)


def _compare_reduced(check_id: CheckId, actual, expected, expected32, what: str, floor: float) -> CheckResult:
    scale = float(expected32.abs().max()) if expected32.numel() else 0.0
    error = float((actual - expected32).abs().max()) if actual.numel() else 0.0
    own = float((expected - expected32).abs().max()) if actual.numel() else 0.0
    bound = BOUND_FACTOR * own + floor * scale
    ok = error <= bound
    detail = "" if ok else (f"{what}: error vs fp32 {error:.2e} > bound {bound:.2e} "
                            f"({BOUND_FACTOR:g} x single-device error {own:.2e} + {floor:g} x {scale:.2e})")
    return CheckResult(check_id, Status.PASS if ok else Status.FAIL, detail, error, error / max(scale, 1e-12),
                       data={"single_device_error": own, "bound": bound, "ratio": error / max(bound, 1e-30)})


@dataclass
class Named:
    """Named tensors held to a reference's by name: the names on one side only, the names beyond the rule
    (worst first, as (max_abs, name, detail); max_abs is inf where a shape or finiteness failed), and the
    largest max_abs (with its name) and max_rel over every name compared."""
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    failing: list[tuple[float, str, str]] = field(default_factory=list)
    max_abs: float = 0.0
    max_rel: float = 0.0
    worst: str | None = None


def compare_named(check_id: CheckId, actual: dict, expected: dict, atol: float, rtol: float,
                  names: set | None = None) -> Named:
    """Every name of `expected` against `actual` by `compare`; `names`: the names the parallel side holds where
    they are more than `actual`'s (a pipeline stage holds its own, the stages together hold all). atol = rtol = 0
    asks for equality."""
    names = set(actual) if names is None else names
    out = Named(sorted(set(expected) - names), sorted(names - set(expected)))
    for name in sorted(set(actual) & set(expected)):
        result = compare(check_id, actual[name], expected[name], atol, rtol, name)
        if (result.max_abs or 0.0) >= out.max_abs:
            out.max_abs, out.worst = result.max_abs or 0.0, name
        out.max_rel = max(out.max_rel, result.max_rel or 0.0)
        if result.status == Status.FAIL:
            out.failing.append((result.max_abs if result.max_abs is not None else float("inf"), name, result.detail))
    out.failing.sort(key=lambda item: (-item[0], item[1]))
    return out


def problems_text(items: list[str], limit: int = 3) -> str:
    """The first `limit` problems, joined, and how many more there are."""
    more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
    return "; ".join(items[:limit]) + more
