"""`parity.grads` on a torch model: every parameter's gradient, gathered whole, against the reference's, by names
read through wrappers (`names`); a parameter named on one side only is named as that."""

from __future__ import annotations

from paracheck.adapters.torch import names
from paracheck.checks.grads import compare_grads
from paracheck.checks.shards import full
from paracheck.domain.records import CheckResult


def check(model, ref_grads: dict, layout, atol: float, rtol: float) -> CheckResult:
    """`ref_grads`: clean name -> the reference's gradient (None where it has none)."""
    params = names.parameters(model)
    pairs = ((name, full(p.grad), ref_grads[name]) for name, p in params.items() if name in ref_grads)
    unmatched = {"parallel": [n for n in params if n not in ref_grads],
                 "reference": [n for n in ref_grads if n not in params]}
    degrees = {"tp": layout.tp, "dp": layout.dp, "fsdp": layout.fsdp, "cp": layout.cp, "world": layout.world}
    return compare_grads(pairs, atol, rtol, degrees, unmatched)
