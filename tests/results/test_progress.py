"""Progress while a run goes: done, left and the time left, on a terminal (a bar) and in a log (a line now and then)."""

import io

from hypothesis import given, strategies as st

from paracheck.domain.case import Case
from paracheck.adapters.diffusers.layout import DiffusersLayout, parse_layouts
from paracheck.domain.records import RankResult, RankStatus
from paracheck.results.progress import EVERY_SECONDS, QUIET_FOR, Estimate, Progress, duration


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _cases(n: int) -> list[Case]:
    layout = parse_layouts("u4", 4)[0]
    return [Case(f"m{i}", "paracheck.fixtures:flux", layout, library="diffusers") for i in range(n)]


def _skip(index: int) -> list[RankResult]:
    return [RankResult(index, r, RankStatus.SKIP, reason="planted skip") for r in range(4)]


def _run(total: int, seconds_each: float, quiet: bool = True):
    clock, log, bar = Clock(), io.StringIO(), None
    progress = Progress(_cases(total), quiet=quiet, out=io.StringIO(), log=log, clock=clock)
    for index in range(total):
        clock.now += seconds_each
        progress.case_done(index, _skip(index))
    progress.close()
    return log.getvalue().splitlines()


def test_a_log_gets_a_line_each_tenth_of_the_cases_with_done_left_and_the_time_left():
    lines = _run(100, 1.0)
    assert len(lines) == 9, lines  # 10%, 20%, ... 90%; the last case is the table's to tell
    assert lines[0] == "paracheck: 10/100 cases done, 90 left, 0 failing, 10s so far, ~1m30s left"
    assert lines[-1].startswith("paracheck: 90/100 cases done, 10 left,") and lines[-1].endswith("~10s left")


def test_slow_cases_get_a_line_every_thirty_seconds_and_a_short_run_none():
    lines = _run(1000, EVERY_SECONDS / 2)
    assert lines and all(" cases done, " in l for l in lines)
    assert len(lines) == 1000 // 2 - 1, len(lines)  # every second case (30 s), none after the last
    assert _run(3, QUIET_FOR / 4) == []


def test_a_terminal_gets_the_bar_and_no_log_lines():
    clock, bar, log = Clock(), io.StringIO(), io.StringIO()
    progress = Progress(_cases(4), out=io.StringIO(), bar=bar, log=log, clock=clock)
    for index in range(2):
        clock.now += 10
        progress.case_done(index, _skip(index))
    assert "2/4, 2 left, ~20s to go" in bar.getvalue() and "next: m2-u4-auto" in bar.getvalue()
    assert log.getvalue() == ""


def test_the_estimate_leaves_out_the_first_cases_start():
    estimate = Estimate()
    assert estimate.left(0, 10, 0.0, 0.0) is None
    assert estimate.left(1, 10, 60.0, 0.0) == 60.0 * 9  # one case known: its time, start included
    assert estimate.left(3, 10, 64.0, 0.0) == 2.0 * 7   # after it: the pace of the cases since


@given(st.floats(min_value=0, max_value=10 ** 6))
def test_duration_reads_back(seconds):
    text = duration(seconds)
    parts = text.lstrip("~").replace("h", " h ").replace("m", " m ").replace("s", " s ").split()
    units = {"h": 3600, "m": 60, "s": 1}
    total = sum(int(parts[i]) * units[parts[i + 1]] for i in range(0, len(parts), 2))
    assert abs(total - seconds) <= (60 if seconds >= 3600 else 0.5) and text.startswith("~")
    assert duration(None) == "?"


def test_the_cases_left_are_priced_by_the_cases_of_their_kind():
    """Ten quick diffusers cases, then five transformers cases that train (4 s each): once one of those is done,
    the four left are priced at its pace, not at the quick cases' (the --all run's tail: "~20s left" with 22
    training cases of about 4 s each to go)."""
    from dataclasses import replace

    from paracheck.results.progress import kinds_of

    quick = [Case(f"m{i}", f"f:m{i}", DiffusersLayout.parse("u4"), library="diffusers") for i in range(10)]
    slow = [replace(Case(f"t{i}", f"f:t{i}", DiffusersLayout.parse("u4"), library="transformers"), steps=3, checkpoint=True)
            for i in range(5)]
    estimate, now, left = Estimate(), 0.0, None
    remaining = {}
    for case in quick + slow:
        remaining[kinds_of(case)] = remaining.get(kinds_of(case), 0) + 1
    for done, (case, seconds) in enumerate([(c, 0.5) for c in quick] + [(slow[0], 4.0)], start=1):
        now += seconds
        estimate.learn(case, seconds, first=done == 1)
        remaining[kinds_of(case)] -= 1
        left = estimate.left(done, 15, now, 0.0, remaining)
    assert left == 16.0  # the four transformers cases left, at 4 s each; the overall pace would say 4 x 0.85 s
    # No kind of theirs seen yet: a case is priced at every case's mean.
    assert Estimate(seconds={(): [10.0, 4]}, counted=10.0, first_done=1.0).left(
        5, 7, 11.0, 0.0, {kinds_of(slow[1]): 2}) == 5.0
