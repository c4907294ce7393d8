"""The gradient rule every adapter shares: each parameter's gradient against the reference's (`judge`), with the
parameters of the rule one adapter sets (`Rule`), and the plain `parity.grads` result over them (`compare_grads`),
with each parameter's entry and the pattern (`checks.localize`) when it fails."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterable, Mapping

import torch

from paracheck.checks import localize
from paracheck.checks.compare import compare, problems_text
from paracheck.domain.localization import GradRow
from paracheck.domain.records import CheckId, CheckResult, Status

#: Why a parameter is compared with nothing: it is named on one side only.
ONE_SIDE = {"parallel": "in the parallel model only", "reference": "in the reference only"}


@dataclass(frozen=True)
class Rule:
    """How strictly the rule judges, where an adapter sets more than the plain rule (every default is the plain
    rule's). `zero_is_none`: a parameter without a gradient is no problem where the reference's gradient is all
    zeros (the loss never reached it). `expected32`: name -> the fp32 single-device gradient of a reduced-precision
    run (`compare`'s rule for those, its floor one unit of the gradient's dtype). `second_look(name, grad, want)`:
    where a gradient fails, a judgment against a truer gradient (None where there is none); the gradient passes
    where that one does, its data that judgment's, marked `marked`."""
    zero_is_none: bool = False
    expected32: Mapping | None = None
    second_look: Callable | None = None
    marked: str = ""


PLAIN = Rule()


@dataclass(frozen=True)
class Judged:
    """One parameter judged: its entry, and its comparison (None where only one side has a gradient); `second`:
    whether the second look passed it."""
    name: str
    entry: GradRow
    result: CheckResult | None = None
    second: bool = False

    @property
    def failed(self) -> bool:
        return self.result is None or self.result.status != Status.PASS


def judge(pairs: Iterable, atol: float, rtol: float, rule: Rule = PLAIN) -> list[Judged]:
    """`pairs`: (name, gathered gradient or None, reference gradient or None) per parameter, in the order to judge.
    A gradient on one side only fails (see `Rule.zero_is_none`); one on neither side is left out."""
    out = []
    for name, grad, want in pairs:
        if grad is None and want is not None and rule.zero_is_none and not bool(want.abs().max() > 0):
            want = None
        if grad is None or want is None:
            if (grad is None) != (want is None):
                out.append(Judged(name, localize.grad_entry(name, grad, want, atol, rtol)))
            continue
        expected32 = (rule.expected32 or {}).get(name)
        result = compare(CheckId.GRADS, grad, want, atol, rtol, name, expected32=expected32,
                         floor=torch.finfo(want.dtype).eps if want.is_floating_point() else 0.0)
        second = False
        if result.status == Status.FAIL and rule.second_look is not None:
            again = rule.second_look(name, grad, want)
            if again is not None and again.status == Status.PASS:
                result, second = replace(result, status=Status.PASS, detail="",
                                         data=dict(again.data, rule=rule.marked)), True
        out.append(Judged(name, _entry(name, grad, want, result, atol, rtol), result, second))
    return out


def _entry(name: str, grad, want, result: CheckResult, atol: float, rtol: float) -> GradRow:
    """A parameter's entry, judged by the rule's own verdict (the reduced-precision one, where it applies: then
    `over` is that rule's ratio)."""
    entry = replace(localize.grad_entry(name, grad, want, atol, rtol), within=result.status == Status.PASS)
    if "ratio" in (result.data or {}):
        ratio = result.data["ratio"]
        entry = replace(entry, over=None if ratio == float("inf") else ratio)
    return entry


def localization(judged: list[Judged], degrees: dict) -> dict:
    """A failing check's localization: every parameter's entry and the pattern."""
    return {"grads": localize.grads_localization([j.entry for j in judged], degrees or {}).to_json()}


def compare_grads(pairs, atol: float, rtol: float, degrees: dict | None = None,
                  unmatched: dict | None = None) -> CheckResult:
    """The plain rule's result (`judge`): a gradient on one side only is a problem; the worst max_abs and max_rel
    are over every parameter compared. `unmatched`: {"parallel": names, "reference": names} of parameters one model
    has and the other lacks, each a problem of its own kind (a name, not a tolerance). A failing check names the
    parameters beyond tolerance (by max_abs) and carries every parameter's entry and the pattern (`degrees`: the
    layout's degrees by name, which the pattern may name a factor after)."""
    judged = judge(pairs, atol, rtol)
    compared = [j.result for j in judged if j.result is not None]
    worst = max([r.max_abs or 0.0 for r in compared], default=0.0)
    worst_rel = max([r.max_rel or 0.0 for r in compared], default=0.0)
    one_sided = [f"{j.name}: gradient {'missing' if j.entry.why == 'no gradient' else 'where the reference has none'}"
                 for j in judged if j.result is None]
    beyond = [f"{j.name} max_abs {j.result.max_abs:.1e}" if j.result.max_abs is not None else j.result.detail
              for j in judged if j.result is not None and j.failed]
    unnamed = {side: list(names) for side, names in (unmatched or {}).items() if names}
    judged += [Judged(name, unmatched_entry(name, side)) for side, names in unnamed.items() for name in names]
    if not beyond and not one_sided and not unnamed:
        return CheckResult(CheckId.GRADS, Status.PASS, "", worst, worst_rel, atol, rtol)
    parts = [f"{len(names)} parameters {ONE_SIDE[side]}: {problems_text(names)}" for side, names in unnamed.items()]
    parts += [f"{len(one_sided)} gradients on one side only: {problems_text(one_sided)}"] if one_sided else []
    parts += [f"{len(beyond)} gradients beyond tolerance: {problems_text(beyond)}"] if beyond else []
    failing = len(beyond) + len(one_sided) + sum(map(len, unnamed.values()))
    return CheckResult(CheckId.GRADS, Status.FAIL, "; ".join(parts), worst, worst_rel, atol, rtol,
                       data={"failing": failing, "localization": localization(judged, degrees)})


def unmatched_entry(name: str, side: str) -> GradRow:
    """The gradient table's entry for a parameter named on one side only (`side`: "parallel" or "reference")."""
    return GradRow(name, None, None, False, None, ONE_SIDE[side])
