"""Nothing a run started outlives the `paracheck` process: ranks, what they started, the fork server, the
resource tracker."""

import os
import subprocess
import sys
import time
import uuid

import pytest

from paracheck.launch import reaper
from tests.support import ROOT, SPECS


def _marked(mark: str) -> dict[int, str]:
    """Live processes of this user whose environment carries `mark` (a run's processes inherit it; the
    fork server's forks show the server's environment, which it took from the run)."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as handle:
                if mark.encode() not in handle.read():
                    continue
            with open(f"/proc/{name}/stat") as handle:
                if handle.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    continue
            with open(f"/proc/{name}/cmdline", "rb") as handle:
                found[int(name)] = handle.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    return found


@pytest.mark.slow
def test_nothing_outlives_a_run_that_hung(tmp_path):
    """The CLI in a process of its own, ending on a hang (exit 3): once it has exited, no process it started
    is alive. Watching while it runs proves the scan sees them (ranks, fork server, resource tracker)."""
    mark = uuid.uuid4().hex
    env = dict(os.environ, PARACHECK_TEST_MARK=mark, TMPDIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "paracheck", "run", "--spec", f"{SPECS}:rank1_hangs",
                             "--layouts", "u4", "--timeout", "10", "--quiet"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: dict[int, str] = {}
    deadline = time.monotonic() + 600  # a guard against a run that never exits, not a measurement
    while proc.poll() is None and time.monotonic() < deadline:
        seen.update(_marked(mark))
        time.sleep(0.2)
    if proc.poll() is None:
        for pid in _marked(mark):
            os.kill(pid, 9)
        pytest.fail(f"paracheck did not exit: {proc.communicate()[0]}")
    out = proc.stdout.read()
    left = _marked(mark)
    assert proc.returncode == 3 and "hung past --timeout 10s" in out, out
    kinds = {"forkserver" if "forkserver" in c else "tracker" if "resource_tracker" in c else "cli"
             for pid, c in seen.items()}
    assert kinds == {"cli", "forkserver", "tracker"} and len(seen) >= 4 + 3, seen
    assert left == {}, f"alive after paracheck exited: {left}"


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
