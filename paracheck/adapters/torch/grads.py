"""`parity.grads` on a torch model: every parameter's gradient, gathered whole, against the reference's, by names
read through wrappers (`names`); a parameter named on one side only is named as that."""

from __future__ import annotations

from paracheck.checks.grads import compare_grads
from paracheck.checks.shards import full
from paracheck.domain.records import CheckResult


def check(params: dict, ref_grads: dict, layout, atol: float, rtol: float, held: set | None = None) -> CheckResult:
    """`params`: the parallel model's, by clean name (`names.parameters`); `ref_grads`: clean name -> the
    reference's gradient (None where it has none); `held`: the names some rank holds, where a rank holds a part of
    the model only (a pipeline's stages), so a name another rank holds is not missing."""
    pairs = ((name, full(p.grad), ref_grads[name]) for name, p in params.items() if name in ref_grads)
    unmatched = {"parallel": [n for n in params if n not in ref_grads],
                 "reference": [n for n in ref_grads if n not in params and n not in (held or ())]}
    return compare_grads(pairs, atol, rtol, layout.factor_degrees(), unmatched)
