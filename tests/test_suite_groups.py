"""tests/suite_groups.py: one world at a time puts every slow test in `worlds`; two at once keeps each session run's
readers together, each module's worlds together, and the hanging run's readers apart; the opt-in refuses a typo."""

import pytest
from hypothesis import given, strategies as st

from tests.suite_groups import ENV, SHARED_RUNS, group_of, worlds_at_once

_fixtures = st.lists(st.sampled_from([*SHARED_RUNS, "tmp_path", "one_rank_world"]), unique=True)
_modules = st.sampled_from(["tests/cli/test_run.py", "tests/pytest/test_mixins.py", "tests/rank/test_worker.py"])


@given(_fixtures, _modules, st.booleans())
def test_one_world_at_a_time_is_one_group_for_every_world(fixtures, module, slow):
    group = group_of(fixtures, module, slow, 1)
    if "hung_run" in fixtures:
        assert group == "hung_run"
    else:
        assert group == ("worlds" if slow else None)


@given(_fixtures, _modules, st.booleans())
def test_two_worlds_split_by_the_world_a_test_launches(fixtures, module, slow):
    group = group_of(fixtures, module, slow, 2)
    if "hung_run" in fixtures:
        assert group == "hung_run"
    elif not slow:
        assert group is None  # in process: scheduled freely, as before
    elif "default_run" in fixtures:
        assert group == "default_run"  # launched once, whichever modules read it
    elif "html_run" in fixtures or "pipeline_run" in fixtures:
        assert group == "reports"
    else:
        assert group == f"worlds:{module}"


def test_the_browser_test_shares_both_report_runs_group():
    # it reads html_run and pipeline_run: apart, one of them would be launched on both workers
    assert group_of(["html_run", "pipeline_run"], "tests/results/test_html_browser.py", True, 2) == \
        group_of(["html_run"], "tests/results/test_html.py", True, 2) == \
        group_of(["pipeline_run"], "tests/adapters/diffusers/test_pipelines.py", True, 2)


def test_the_opt_in_reads_1_or_2_and_refuses_anything_else():
    assert worlds_at_once({}) == 1 and worlds_at_once({ENV: ""}) == 1
    assert worlds_at_once({ENV: "1"}) == 1 and worlds_at_once({ENV: " 2 "}) == 2
    for typo in ("3", "two", "yes", "0"):
        with pytest.raises(ValueError, match=ENV):
            worlds_at_once({ENV: typo})
