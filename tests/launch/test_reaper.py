"""Nothing a run started outlives the `paracheck` process: ranks, what they started, the fork server, the
resource tracker."""

import os
import subprocess
import sys
import time

import pytest

from paracheck.launch import reaper
from tests.support import HANG_TIMEOUT


def test_nothing_outlives_a_run_that_hung(hung_run):
    """The CLI in a process of its own, ending on a hang (exit 3): once it has exited, no process it started
    is alive. Watching while it ran proves the scan sees them (ranks, fork server, resource tracker)."""
    assert hung_run.code == 3 and f"hung past --timeout {HANG_TIMEOUT}s" in hung_run.out, hung_run.out
    kinds = {"forkserver" if "forkserver" in c else "tracker" if "resource_tracker" in c else "cli"
             for pid, c in hung_run.seen.items()}
    assert kinds == {"cli", "forkserver", "tracker"} and len(hung_run.seen) >= 4 + 3, hung_run.seen
    assert hung_run.left == {}, f"alive after paracheck exited: {hung_run.left}"


def test_a_recorded_session_is_ended_with_what_it_started(monkeypatch):
    """A rank-like process leading its own session, with a child of its own, is killed with that child, and the
    exit hook's pass leaves nothing behind. (A record of its own: the session's fork server, recorded by the
    in-process runs before this test, must survive it.)"""
    monkeypatch.setattr(reaper, "_started", {})
    leader = subprocess.Popen([sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '300']); "
                               "time.sleep(300)"], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not reaper._session_members({leader.pid}) and time.monotonic() < deadline:
            time.sleep(0.05)
        child = reaper._session_members({leader.pid})
        assert child, "the leader's child never started"
        reaper.record(leader.pid)
        assert set(reaper.left()) == {leader.pid, *child}
        assert reaper.end_all() == []
        leader.wait(10)
        assert reaper._session_members({leader.pid}) == [] and leader.returncode == -9
    finally:
        leader.kill()
        for pid in reaper._session_members({leader.pid}):
            os.kill(pid, 9)


def test_a_reused_pid_is_never_signalled():
    """A record whose start time no longer matches names another process now: it counts as gone."""
    sleeper = subprocess.Popen(["sleep", "300"])
    try:
        entry = reaper.Started(sleeper.pid, "1", "rank")  # not this process's start time
        assert not reaper.alive(entry)
        assert reaper.alive(reaper.Started(sleeper.pid, reaper.start_time(sleeper.pid), "rank"))
    finally:
        sleeper.kill()
        sleeper.wait()


def test_record_names_the_kinds():
    with pytest.raises(ValueError, match="kind 'worker': must be rank or server"):
        reaper.record(os.getpid(), "worker")
