"""Every parameter's gradient against the reference's, as one `parity.grads` result: the rule adapters share, with
each parameter's entry and the pattern (`checks.localize`) when it fails."""

from __future__ import annotations

from paracheck.checks import localize
from paracheck.checks.compare import compare, problems_text
from paracheck.domain.records import CheckId, CheckResult, Status


def compare_grads(pairs, atol: float, rtol: float, degrees: dict | None = None) -> CheckResult:
    """`pairs`: (name, gathered gradient or None, reference gradient or None) per parameter. A gradient on one
    side only is a problem; the worst max_abs and max_rel are over every parameter compared. A failing check
    names the parameters beyond tolerance (by max_abs) and carries every parameter's entry and the pattern
    (`degrees`: the layout's degrees by name, which the pattern may name a factor after)."""
    problems, worst, worst_rel, entries = [], 0.0, 0.0, []
    for name, grad, want in pairs:
        if grad is None or want is None:
            if (grad is None) != (want is None):
                problems.append(f"{name}: gradient {'missing' if grad is None else 'where the reference has none'}")
                entries.append(localize.grad_entry(name, grad, want, atol, rtol))
            continue
        result = compare(CheckId.GRADS, grad, want, atol, rtol, name)
        worst, worst_rel = max(worst, result.max_abs or 0.0), max(worst_rel, result.max_rel or 0.0)
        entries.append(dict(localize.grad_entry(name, grad, want, atol, rtol), within=result.status == Status.PASS))
        if result.status != Status.PASS:
            problems.append(f"{name} max_abs {result.max_abs:.1e}" if result.max_abs is not None else result.detail)
    if not problems:
        return CheckResult(CheckId.GRADS, Status.PASS, "", worst, worst_rel, atol, rtol)
    return CheckResult(CheckId.GRADS, Status.FAIL, f"{len(problems)} gradients beyond tolerance: "
                       f"{problems_text(problems)}", worst, worst_rel, atol, rtol,
                       data={"failing": len(problems),
                             "localization": {"grads": localize.grads_localization(entries, degrees or {})}})
