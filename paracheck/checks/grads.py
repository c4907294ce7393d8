"""Every parameter's gradient against the reference's, as one `parity.grads` result: the rule adapters share."""

from __future__ import annotations

from paracheck.checks.compare import compare, problems_text
from paracheck.domain.records import CheckId, CheckResult, Status


def compare_grads(pairs, atol: float, rtol: float) -> CheckResult:
    """`pairs`: (name, gathered gradient or None, reference gradient or None) per parameter. A gradient on one
    side only is a problem; the worst max_abs and max_rel are over every parameter compared."""
    problems, worst, worst_rel = [], 0.0, 0.0
    for name, grad, want in pairs:
        if grad is None or want is None:
            if (grad is None) != (want is None):
                problems.append(f"{name}: gradient {'missing' if grad is None else 'where the reference has none'}")
            continue
        result = compare(CheckId.GRADS, grad, want, atol, rtol, name)
        worst, worst_rel = max(worst, result.max_abs or 0.0), max(worst_rel, result.max_rel or 0.0)
        if result.status != Status.PASS:
            problems.append(f"{name} off by {result.max_abs:.1e}" if result.max_abs is not None else result.detail)
    detail = f"gradients differ: {problems_text(problems)}" if problems else ""
    return CheckResult(CheckId.GRADS, Status.FAIL if problems else Status.PASS, detail, worst, worst_rel, atol, rtol,
                       data={"failing": len(problems)} if problems else {})
