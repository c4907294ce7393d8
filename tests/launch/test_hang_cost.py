"""A hang costs one timeout: after a case hangs, the cases left on its model and layout are reported, not run."""

import pytest

from paracheck.domain.case import Case
from paracheck.adapters.diffusers.layout import parse_layouts
from paracheck.launch.launcher import Launcher, meets_hang_again
from tests.support import HANG_TIMEOUT


def _case(model="flux", layout="u4", **fields) -> Case:
    return Case(model, f"paracheck.fixtures:{model}", parse_layouts(layout, 4)[0], library="diffusers", **fields)


def test_the_cases_that_meet_a_hang_again_share_its_model_and_layout():
    hung = _case()
    left = [_case(variant="batch2"), _case(control="backward-only"), _case(layout="r4"), _case(model="wan"),
            _case(model="flux", layout="u4", variant="masked")]
    assert meets_hang_again(left, hung, [10, 11, 12, 13, 14]) == [10, 11, 14]
    assert meets_hang_again([], hung, []) == []


def test_after_hang_names_its_choices():
    with pytest.raises(ValueError, match="after_hang 'retry': must be one of skip, run"):
        Launcher(None, 4, 10.0, after_hang="retry")


def test_one_timeout_per_model_and_layout(hung_run):
    """Every case of a spec whose rank 1 never finishes a collective hangs: on each layout the plain case hangs
    once and its controls are reported not run, naming it; the next layout still gets its own world."""
    wait = f"hung past --timeout {HANG_TIMEOUT}s"
    assert hung_run.code == 3, hung_run.out
    hangs = [e for e in hung_run.report["events"] if e["kind"] == "hang"]
    assert len(hangs) == 2, hung_run.report["events"]
    for layout in ("u4", "tp4"):
        plain = hung_run.case("rank1_hangs", layout)
        assert plain["status"] == "error" and wait in plain["reason"], plain["reason"]
        controls = [c for c in hung_run.report["cases"] if c["layout"] == layout and c["control"]]
        assert controls, f"no control cases on {layout}"
        for case in controls:
            assert case["status"] == "skip", case
            assert f"not run: rank1_hangs-{layout}-auto {wait}" in case["reason"], case["reason"]
