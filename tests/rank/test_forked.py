"""`rank.forked.fork_ranks`: a harness's ranks forked from the kit's fork server report a raise with its rank's
traceback, and are killed at their deadline instead of hanging the caller."""

import time

import pytest

from paracheck.rank.forked import fork_ranks

# Each test forks ranks from the kit's fork server, whose start imports torch and both libraries.
pytestmark = pytest.mark.slow


def _sleeps(rank, seconds):
    time.sleep(seconds)


def _writes(rank, folder):
    with open(f"{folder}/rank{rank}", "w") as handle:
        handle.write(str(rank))


def _raises_on_rank_1(rank):
    if rank == 1:
        raise ValueError("planted on rank 1")


def test_every_rank_runs_and_returns(tmp_path):
    """Each rank leaves its mark, and only once every rank has does the call return."""
    fork_ranks(_writes, (str(tmp_path),), 2)
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {"rank0": "0", "rank1": "1"}


def test_a_rank_that_raises_is_raised_here():
    with pytest.raises(Exception, match="planted on rank 1"):
        fork_ranks(_raises_on_rank_1, (), 2)


def test_ranks_past_their_deadline_are_killed():
    # The ranks sleep a minute: without the deadline they would return cleanly, and no TimeoutError come.
    with pytest.raises(TimeoutError, match="still running"):
        fork_ranks(_sleeps, (60,), 2, timeout=2)
