"""Every process a run started, ended by the time the process that started them exits.

Ranks lead their own sessions and are forked from multiprocessing's fork server, which multiprocessing's
resource tracker serves; left alone, the server and the tracker leave only once every holder of their
pipes has gone, seconds after the parent on a loaded machine (a killed rank takes that long to free its
memory). So each is recorded here by pid, with its start time so that a pid the system has since handed
to another process is never signalled, and at exit this process waits for them, ends what remains
(SIGKILL for ranks and their sessions, SIGTERM then SIGKILL for the servers) and waits until every one
is gone. The servers are ended at exit, not at the end of a run: a pytest session shares one fork server
across its in-process runs on purpose. Torch-free; Linux reads `/proc`, elsewhere a pid is all there is.
"""

from __future__ import annotations

import atexit
import os
import signal
import time
from dataclasses import dataclass

#: Seconds a server gets to leave on its own after SIGTERM (or a tracker after its pipe closes).
SERVER_GRACE = 2.0
#: Seconds to wait for a killed process to be gone (a SIGKILLed rank frees its memory first).
GONE_WAIT = 30.0
_POLL = 0.05


@dataclass(frozen=True)
class Started:
    pid: int
    start: str | None   # /proc/PID/stat's start time, so a reused pid is told apart
    kind: str           # "rank" (leads its own session) | "server" (a child of this process)


_started: dict[int, Started] = {}
_hooked: list[bool] = []


def start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (clock ticks after boot), None where unreadable or gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            stat = handle.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()[19]


def record(pid: int, kind: str = "rank") -> None:
    """Remember a process this one started; the first record arms the exit hook."""
    if kind not in ("rank", "server"):
        raise ValueError(f"kind {kind!r}: must be rank or server")
    if pid not in _started:
        _started[pid] = Started(pid, start_time(pid), kind)
    if not _hooked:
        _hooked.append(True)
        atexit.register(end_all)


def record_servers() -> None:
    """Record the fork server and resource tracker if this process started them (a process forked from a
    server inherits no pid for it, so there is nothing to record there)."""
    import multiprocessing.forkserver as forkserver
    import multiprocessing.resource_tracker as tracker

    for pid in (getattr(forkserver._forkserver, "_forkserver_pid", None),
                getattr(tracker._resource_tracker, "_pid", None)):
        if pid is not None:
            record(pid, "server")


def alive(entry: Started) -> bool:
    """The recorded process still exists (a zombie counts as gone: it holds nothing but its pid)."""
    if entry.start is None and not os.path.exists("/proc"):
        try:
            os.kill(entry.pid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    return entry.start is not None and start_time(entry.pid) == entry.start and _state(entry.pid) not in ("Z", "X")


def left() -> list[int]:
    """Pids of recorded processes, and of members of recorded ranks' sessions, still alive."""
    found = [e.pid for e in _started.values() if alive(e)]
    return found + [pid for pid in _session_members(_sessions()) if pid not in found]


def end_all(grace: float = SERVER_GRACE) -> list[int]:
    """End every recorded process that is still alive, ranks (and what they started) first, then the
    servers; wait until each is gone. Returns the pids that outlived even SIGKILL (none, normally)."""
    ranks = [e for e in _started.values() if e.kind == "rank"]
    for entry in ranks:
        if alive(entry):
            _signal(entry.pid, signal.SIGKILL, group=True)
    for pid in _session_members(_sessions()):
        _signal(pid, signal.SIGKILL)
    _wait(lambda: [e.pid for e in ranks if alive(e)] + _session_members(_sessions()), GONE_WAIT)
    servers = [e for e in _started.values() if e.kind == "server"]
    forkservers, trackers = _split_servers(servers)
    for entry in forkservers:
        _end_child(entry, grace, signal.SIGTERM)
    for entry in trackers:
        _close_tracker()
        _end_child(entry, grace, None)
    stuck = left()
    if not stuck:
        _started.clear()
    return stuck


def _split_servers(servers: list[Started]) -> tuple[list[Started], list[Started]]:
    import multiprocessing.resource_tracker as tracker

    pid = getattr(tracker._resource_tracker, "_pid", None)
    return [e for e in servers if e.pid != pid], [e for e in servers if e.pid == pid]


def _close_tracker() -> None:
    """Close this process's end of the tracker's pipe: the tracker then cleans up and leaves on its own
    (it ignores SIGTERM and SIGINT). multiprocessing's own `_stop` would wait without a limit."""
    import multiprocessing.resource_tracker as tracker

    rt = tracker._resource_tracker
    with rt._lock:
        if rt._fd is not None:
            os.close(rt._fd)
            rt._fd = None
            rt._pid = None


def _end_child(entry: Started, grace: float, first: signal.Signals | None) -> None:
    """A server is this process's own child: ask (or let) it leave, SIGKILL it after `grace`, reap it."""
    if not alive(entry):
        _reap(entry.pid)
        return
    if first is not None:
        _signal(entry.pid, first)
    if _wait(lambda: [entry.pid] if alive(entry) and not _reap(entry.pid) else [], grace):
        _signal(entry.pid, signal.SIGKILL)
        _wait(lambda: [entry.pid] if alive(entry) and not _reap(entry.pid) else [], GONE_WAIT)
    _forget_forkserver(entry.pid)


def _forget_forkserver(pid: int) -> None:
    """A server ended here is not one a later start in this process may reuse."""
    import multiprocessing.forkserver as forkserver

    server = forkserver._forkserver
    if getattr(server, "_forkserver_pid", None) == pid:
        with server._lock:
            if server._forkserver_alive_fd is not None:
                os.close(server._forkserver_alive_fd)
            server._forkserver_pid = server._forkserver_alive_fd = server._forkserver_address = None


def _reap(pid: int) -> bool:
    """Collect a child's exit status; True once it has exited."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == pid
    except ChildProcessError:
        return True


def _wait(pending, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while (still := pending()) and time.monotonic() < deadline:
        time.sleep(_POLL)
    return still


def _signal(pid: int, signum: int, group: bool = False) -> None:
    try:
        if group and os.getpgid(pid) == pid:
            os.killpg(pid, signum)
        else:
            os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            stat = handle.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()[0]


def _sessions() -> set[int]:
    """The recorded ranks' session ids, less any whose pid now names another process (which would lead
    a session of its own, not the rank's)."""
    return {e.pid for e in _started.values() if e.kind == "rank" and start_time(e.pid) in (None, e.start)}


def _session_members(sessions: set[int]) -> list[int]:
    """Live processes whose session is one of `sessions` (what a rank started; a session id is not handed
    out again while a member lives, so these pids are safe to signal)."""
    if not sessions or not os.path.isdir("/proc"):
        return []
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in sessions:
            continue
        try:
            with open(f"/proc/{name}/stat") as handle:
                stat = handle.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[3]) in sessions and fields[0] not in ("Z", "X"):
            found.append(int(name))
    return found
