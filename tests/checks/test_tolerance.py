"""The reduced-precision rule, on synthetic errors: the parallel error against fp32 may be at most
BOUND_FACTOR times the single-device error at the run's dtype, plus a floor; fp32 keeps atol/rtol."""

import pytest
import torch
from hypothesis import assume, given, strategies as st

from paracheck.checks.compare import BOUND_FACTOR, FLOOR, compare, compare_named
from paracheck.domain.records import CheckId, Status

REF32 = torch.linspace(-1.0, 1.0, 64, dtype=torch.float64)


@given(st.floats(1e-4, 1e-2), st.floats(0.0, 4.0))
def test_bound_is_a_multiple_of_the_single_device_error(own, ratio):
    single = REF32 + own                     # the single-device run at the reduced dtype
    parallel = REF32 + own * ratio           # the parallel run
    result = compare(CheckId.FORWARD, parallel, single, 2e-2, 2e-2, expected32=REF32)
    bound = BOUND_FACTOR * own + FLOOR * 1.0
    # At the bound itself the errors' own rounding (|REF32 + own x ratio - REF32| is not own x ratio) decides:
    # hypothesis found own 1e-3, ratio 3.0, which the test's exact arithmetic passes and the check fails.
    assume(abs(own * ratio - bound) > 1e-9)
    assert result.data["single_device_error"] == pytest_approx(own)
    assert (result.status == Status.PASS) == (own * ratio <= bound + 1e-12)
    # The reported ratio is the error over the bound it was judged by: at most 1 when it passes.
    assert result.data["ratio"] == pytest_approx(result.max_abs / result.data["bound"])
    assert result.data["ratio"] <= 1 if result.status == Status.PASS else result.data["ratio"] >= 1


def test_a_parallel_run_as_accurate_as_one_device_passes_and_reports_both_errors():
    result = compare(CheckId.FORWARD, REF32 + 3e-3, REF32 + 3e-3, 2e-2, 2e-2, expected32=REF32)
    assert result.status == Status.PASS and abs(result.max_abs - 3e-3) < 1e-12
    assert abs(result.data["bound"] - (BOUND_FACTOR * 3e-3 + FLOOR)) < 1e-12


def test_a_bug_several_times_the_noise_fails_even_under_a_loose_fixed_tolerance():
    """A fixed bf16 tolerance (2e-2) would pass this 1.5e-2 shift; the measured rule does not."""
    result = compare(CheckId.FORWARD, REF32 + 1.5e-2, REF32 + 3e-3, 2e-2, 2e-2, expected32=REF32)
    assert result.status == Status.FAIL and "single-device error" in result.detail


def test_fp32_keeps_elementwise_tolerances():
    assert compare(CheckId.FORWARD, REF32 + 1e-7, REF32, 1e-5, 1e-5).status == Status.PASS
    assert compare(CheckId.FORWARD, REF32 + 3e-2, REF32, 1e-5, 1e-5).status == Status.FAIL


def pytest_approx(x):
    import pytest

    return pytest.approx(x, rel=1e-9, abs=1e-12)


@given(st.dictionaries(st.sampled_from("abcdef"), st.floats(-1.0, 1.0, allow_nan=False), max_size=6),
       st.dictionaries(st.sampled_from("abcdef"), st.floats(-1.0, 1.0, allow_nan=False), max_size=6))
def test_named_tensors_are_held_by_name_worst_first(ours, theirs):
    """`compare_named`: the names on one side only, every shared name beyond the rule worst first, the maxima."""
    actual = {n: torch.tensor([v]) for n, v in ours.items()}
    expected = {n: torch.tensor([v]) for n, v in theirs.items()}
    held = compare_named(CheckId.CHECKPOINT, actual, expected, 1e-5, 1e-5)
    assert held.missing == sorted(set(theirs) - set(ours)) and held.extra == sorted(set(ours) - set(theirs))
    shared = set(ours) & set(theirs)
    diffs = {n: abs(float(actual[n]) - float(expected[n])) for n in shared}
    assert {n for _, n, _ in held.failing} == {n for n in shared if diffs[n] > 1e-5 + 1e-5 * abs(float(expected[n]))}
    assert [size for size, _, _ in held.failing] == sorted((size for size, _, _ in held.failing), reverse=True)
    assert held.max_abs == pytest.approx(max(diffs.values(), default=0.0))


def test_named_tensors_at_zero_tolerance_ask_for_equality_and_a_shape_is_worst():
    expected = {"w": torch.ones(2), "b": torch.zeros(3)}
    exact = compare_named(CheckId.CHECKPOINT, {"w": torch.ones(2), "b": torch.zeros(3)}, expected, 0.0, 0.0)
    assert not exact.failing and exact.max_abs == 0.0
    moved = compare_named(CheckId.CHECKPOINT, {"w": torch.ones(2) + 1e-7, "b": torch.zeros(2)}, expected, 0.0, 0.0)
    assert [name for _, name, _ in moved.failing] == ["b", "w"] and "shape" in moved.failing[0][2]
    staged = compare_named(CheckId.CHECKPOINT, {"w": torch.ones(2)}, expected, 0.0, 0.0, names={"w", "b"})
    assert not staged.missing and not staged.failing  # another stage holds b
