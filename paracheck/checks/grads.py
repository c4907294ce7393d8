"""Every parameter's gradient against the reference's, as one `parity.grads` result: the rule adapters share, with
each parameter's entry and the pattern (`checks.localize`) when it fails."""

from __future__ import annotations

from dataclasses import replace

from paracheck.checks import localize
from paracheck.checks.compare import compare, problems_text
from paracheck.domain.localization import GradRow
from paracheck.domain.records import CheckId, CheckResult, Status

#: Why a parameter is compared with nothing: it is named on one side only.
ONE_SIDE = {"parallel": "in the parallel model only", "reference": "in the reference only"}


def compare_grads(pairs, atol: float, rtol: float, degrees: dict | None = None,
                  unmatched: dict | None = None) -> CheckResult:
    """`pairs`: (name, gathered gradient or None, reference gradient or None) per parameter both models have. A
    gradient on one side only is a problem; the worst max_abs and max_rel are over every parameter compared.
    `unmatched`: {"parallel": names, "reference": names} of parameters one model has and the other lacks, each a
    problem of its own kind (a name, not a tolerance). A failing check names the parameters beyond tolerance (by
    max_abs) and carries every parameter's entry and the pattern (`degrees`: the layout's degrees by name, which
    the pattern may name a factor after)."""
    beyond, one_sided, worst, worst_rel, entries = [], [], 0.0, 0.0, []
    for name, grad, want in pairs:
        if grad is None or want is None:
            if (grad is None) != (want is None):
                one_sided.append(f"{name}: gradient {'missing' if grad is None else 'where the reference has none'}")
                entries.append(localize.grad_entry(name, grad, want, atol, rtol))
            continue
        result = compare(CheckId.GRADS, grad, want, atol, rtol, name)
        worst, worst_rel = max(worst, result.max_abs or 0.0), max(worst_rel, result.max_rel or 0.0)
        entries.append(replace(localize.grad_entry(name, grad, want, atol, rtol), within=result.status == Status.PASS))
        if result.status != Status.PASS:
            beyond.append(f"{name} max_abs {result.max_abs:.1e}" if result.max_abs is not None else result.detail)
    unnamed = {side: list(names) for side, names in (unmatched or {}).items() if names}
    entries += [unmatched_entry(name, side) for side, names in unnamed.items() for name in names]
    if not beyond and not one_sided and not unnamed:
        return CheckResult(CheckId.GRADS, Status.PASS, "", worst, worst_rel, atol, rtol)
    parts = [f"{len(names)} parameters {ONE_SIDE[side]}: {problems_text(names)}" for side, names in unnamed.items()]
    parts += [f"{len(one_sided)} gradients on one side only: {problems_text(one_sided)}"] if one_sided else []
    parts += [f"{len(beyond)} gradients beyond tolerance: {problems_text(beyond)}"] if beyond else []
    failing = len(beyond) + len(one_sided) + sum(map(len, unnamed.values()))
    return CheckResult(CheckId.GRADS, Status.FAIL, "; ".join(parts), worst, worst_rel, atol, rtol,
                       data={"failing": failing,
                             "localization": {"grads": localize.grads_localization(entries, degrees or {}).to_json()}})


def unmatched_entry(name: str, side: str) -> GradRow:
    """The gradient table's entry for a parameter named on one side only (`side`: "parallel" or "reference")."""
    return GradRow(name, None, None, False, None, ONE_SIDE[side])
