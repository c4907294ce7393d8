"""The gradient rule every adapter shares (`checks.grads`), in process: the plain rule, and each parameter of the
rule one adapter sets (diffusers': a zero reference gradient standing for none, the reduced-precision truth, a
second look against a truer gradient), each with the gradient it must still fail."""

import torch
from hypothesis import given, settings, strategies as st

from paracheck.checks import grads
from paracheck.checks.compare import compare
from paracheck.domain.records import CheckId, Status

REF = torch.linspace(-1.0, 1.0, 16)


def test_a_missing_gradient_fails_the_plain_rule_even_where_the_reference_is_zero():
    zero = torch.zeros(4)
    result = grads.compare_grads([("a", REF, REF), ("b", None, zero)], 1e-5, 1e-5)
    assert result.status == Status.FAIL and "b: gradient missing" in result.detail
    assert [j.name for j in grads.judge([("b", None, zero)], 1e-5, 1e-5)] == ["b"]


def test_zero_is_none_passes_a_missing_gradient_the_loss_never_reached_and_still_fails_a_reached_one():
    rule = grads.Rule(zero_is_none=True)
    assert grads.judge([("b", None, torch.zeros(4)), ("c", None, None)], 1e-5, 1e-5, rule) == []
    missing = grads.judge([("b", None, REF)], 1e-5, 1e-5, rule)  # the control: a reached parameter without one
    assert [(j.name, j.failed, j.entry.why) for j in missing] == [("b", True, "no gradient")]
    extra = grads.judge([("c", REF, None)], 1e-5, 1e-5, rule)
    assert [(j.failed, j.entry.why) for j in extra] == [(True, "a gradient the reference lacks")]


@settings(max_examples=25, deadline=None)
@given(st.floats(1e-4, 1e-1))
def test_a_second_look_passes_only_what_it_passes_and_marks_it(off):
    grad = REF + off  # beyond atol = rtol = 1e-6 everywhere
    truth = REF + off  # a truer gradient this one matches: the second look passes it
    looked = []

    def look(name, g, want):
        looked.append(name)
        return compare(CheckId.GRADS, g, want, 1e-6, 1e-6, expected32=truth, floor=1e-7)

    [passed] = grads.judge([("w", grad, REF)], 1e-6, 1e-6, grads.Rule(second_look=look, marked="fp64"))
    assert looked == ["w"] and not passed.failed and passed.second and passed.result.data["rule"] == "fp64"
    assert passed.entry.within and passed.entry.over == passed.result.data["ratio"]
    # The control: a second look against the reference itself (no truer gradient) leaves it failing.
    [failed] = grads.judge([("w", grad, REF)], 1e-6, 1e-6, grads.Rule(
        second_look=lambda n, g, want: compare(CheckId.GRADS, g, want, 1e-6, 1e-6, expected32=REF, floor=1e-7)))
    assert failed.failed and not failed.second and not failed.entry.within
    # A gradient within tolerance is never looked at again.
    looked.clear()
    grads.judge([("w", REF.clone(), REF)], 1e-6, 1e-6, grads.Rule(second_look=look))
    assert looked == []


def test_expected32_judges_by_the_reduced_precision_rule_with_its_ratio_as_the_entrys_over():
    ref32 = REF.double()
    single = (REF + 1e-3).to(torch.bfloat16)
    rule = grads.Rule(expected32={"w": ref32})
    [close] = grads.judge([("w", single.clone(), single)], 1e-5, 1e-5, rule)
    assert not close.failed and close.entry.over == close.result.data["ratio"]
    [far] = grads.judge([("w", (REF + 0.5).to(torch.bfloat16), single)], 1e-5, 1e-5, rule)  # the control
    assert far.failed and far.entry.over == far.result.data["ratio"] > 1
