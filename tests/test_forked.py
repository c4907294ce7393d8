"""`rank.forked.fork_ranks`: a harness's ranks forked from the kit's fork server report a raise with its rank's
traceback, and are killed at their deadline instead of hanging the caller."""

import time

import pytest

from paracheck.rank.forked import fork_ranks


def _sleeps(rank, seconds):
    time.sleep(seconds)


def _raises_on_rank_1(rank):
    if rank == 1:
        raise ValueError("planted on rank 1")


def test_every_rank_runs_and_returns():
    fork_ranks(_sleeps, (0.1,), 2)


def test_a_rank_that_raises_is_raised_here():
    with pytest.raises(Exception, match="planted on rank 1"):
        fork_ranks(_raises_on_rank_1, (), 2)


def test_ranks_past_their_deadline_are_killed():
    # The ranks sleep a minute: without the deadline they would return cleanly, and no TimeoutError come.
    with pytest.raises(TimeoutError, match="still running"):
        fork_ranks(_sleeps, (60,), 2, timeout=2)
