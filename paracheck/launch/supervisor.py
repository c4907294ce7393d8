"""The supervisor: start one world of ranks, watch it, stop it, and say how it ended as a `WorldEnd`.

It decides nothing about blame (that is `attribution`) and reads no results (that is `launch`). Ranks
start forked from a prepared parent, torch's `forkserver` with paracheck's imports preloaded, so the
libraries are imported once per run (once per session under pytest) instead of once per rank; where
forking is unsafe they start as fresh interpreters. Each rank leads its own session, so one kill
reaches everything it started. Torch-free.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.util
import os
import signal
import subprocess
import sys
import time

from paracheck.launch import reaper
from paracheck.launch.protocol import (ENV_STORE, ENV_TODO, RANK_MODULE, EndKind, RankProgress, RankExit, RunDir, Todo, WorldEnd,
                                       read_json, write_json)

_POLL = 0.05
#: Seconds for faulthandler (a C signal handler) to write every rank's stack after SIGUSR1.
_STACK_WAIT = 1.0
#: Seconds to let the other ranks finish after one exits with an error, before they are stopped.
_EXIT_GRACE = 3.0
#: The longest AF_UNIX path Linux takes (108 bytes with the terminating NUL), and how much the fork server adds
#: to multiprocessing's temporary folder: "/pymp-XXXXXXXX" (its folder, made under the system's temp folder)
#: and "/listener-XXXXXXXX" (its socket).
_UNIX_PATH_MAX, _SERVER_SUFFIX = 107, len("/pymp-XXXXXXXX/listener-XXXXXXXX")
_LISTENER = len("/listener-XXXXXXXX")
#: Short folders the fork server's socket may live in where TMPDIR is too long for one (CPython 3.14 falls back
#: the same way; 3.11 to 3.13 raise "AF_UNIX path too long" when the first rank starts).
_SHORT_TEMP = ("/tmp", "/var/tmp", "/dev/shm")


def start_method(backend_name: str) -> str:
    """How ranks start on this platform and backend: "fresh" interpreters when PARACHECK_START=fresh asks
    for them, the platform cannot fork, or the backend is neuron (its runtime initialises per process on
    import); else "forkserver", forked from a parent that imported torch and diffusers once."""
    if os.environ.get("PARACHECK_START") == "fresh" or "forkserver" not in multiprocessing.get_all_start_methods():
        return "fresh"
    return "fresh" if backend_name == "neuron" else "forkserver"


@contextlib.contextmanager
def _no_main_module():
    """Start a process without multiprocessing re-running the caller's main module in it (a script with
    no `if __name__ == "__main__"` guard would run again in every rank): ranks need only paracheck."""
    import types

    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _fit_server_socket() -> None:
    """Before the fork server starts: where TMPDIR is too long to hold its socket, make multiprocessing's
    temporary folder in a short system folder instead (multiprocessing still removes it at exit); where no
    short folder is writable, say which folder is too long, by how much, and what to do."""
    import tempfile
    from multiprocessing import process

    import multiprocessing.forkserver as forkserver

    made = process.current_process()._config.get("tempdir")
    if made is not None:  # made earlier in this process: too late to move; fine where it fits or a server listens
        if len(made) + _LISTENER <= _UNIX_PATH_MAX or forkserver._forkserver._forkserver_address is not None:
            return
        raise RuntimeError(_too_long(made, _LISTENER, "multiprocessing's temporary folder, made before this run"))
    base = tempfile.gettempdir()
    if len(base) + _SERVER_SUFFIX <= _UNIX_PATH_MAX:
        return
    short = next((folder for folder in _SHORT_TEMP if os.access(folder, os.W_OK | os.X_OK)), None)
    if short is None:
        raise RuntimeError(_too_long(base, _SERVER_SUFFIX, f"the temporary folder, and none of "
                                                           f"{', '.join(_SHORT_TEMP)} is writable"))
    saved, tempfile.tempdir = tempfile.tempdir, short
    try:
        multiprocessing.util.get_temp_dir()
    finally:
        tempfile.tempdir = saved


def _too_long(folder: str, suffix: int, what: str) -> str:
    return (f"{what}: {folder!r} ({len(folder)} characters) is too long to hold the socket ranks start through (at "
            f"most {_UNIX_PATH_MAX - suffix} characters): set TMPDIR to a shorter folder, or PARACHECK_START=fresh")


class _Rank:
    """One rank process, however it was started."""

    def __init__(self, method: str, rundir: RunDir, env: dict, log: str):
        if method == "forkserver":
            _fit_server_socket()
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(["paracheck.rank.preload"])
            from paracheck.launch.rankstart import rank_entry

            self._proc = context.Process(target=rank_entry, args=(rundir.path, env, log), daemon=False)
            with _no_main_module():
                self._proc.start()
            self.pid = self._proc.pid
            reaper.record_servers()
        else:
            with open(log, "w") as handle:
                self._proc = subprocess.Popen([sys.executable, "-m", RANK_MODULE, rundir.path],
                                              env=dict(os.environ, **env), stdout=handle, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True)
            self.pid = self._proc.pid
        reaper.record(self.pid)

    def poll(self) -> int | None:
        if isinstance(self._proc, subprocess.Popen):
            return self._proc.poll()
        return self._proc.exitcode

    def signal(self, signum: int) -> None:
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """Kill the rank's whole session; never a group it has not made its own yet."""
        try:
            if os.getpgid(self.pid) == self.pid:
                os.killpg(self.pid, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def wait(self, timeout: float) -> None:
        if isinstance(self._proc, subprocess.Popen):
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        else:
            self._proc.join(timeout)


class Supervisor:
    def __init__(self, rundir: RunDir, backend_name: str, nproc: int, timeout: float, startup_timeout: float = 300.0):
        self.rundir, self.backend_name, self.nproc = rundir, backend_name, nproc
        self.timeout, self.startup_timeout = timeout, startup_timeout
        self.method = start_method(backend_name)
        self.ranks: list[_Rank] = []

    def start(self, attempt: int, todo: Todo) -> None:
        for rank in range(self.nproc):
            for path in (self.rundir.progress(rank), self.rundir.stacks(rank)):
                if os.path.exists(path):
                    os.remove(path)
        write_json(self.rundir.todo(attempt), todo.to_json())
        self.ranks = [_Rank(self.method, self.rundir, self._env(rank, attempt), self.rundir.log(attempt, rank))
                      for rank in range(self.nproc)]

    def _env(self, rank: int, attempt: int) -> dict:
        env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(self.nproc),
               "LOCAL_WORLD_SIZE": str(self.nproc), ENV_STORE: self.rundir.store(attempt),
               ENV_TODO: os.path.basename(self.rundir.todo(attempt)), "PYTHONUNBUFFERED": "1",
               "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1")}
        if self.backend_name == "gloo":
            env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
        return env

    def watch(self, attempt: int, tick=None, until=None) -> WorldEnd | None:
        """Poll until the world ends; `tick()` runs every poll (the launcher reads results there). With
        `until`, return None as soon as `until()` holds and the world is still up."""
        started = time.time()
        while True:
            if tick:
                tick()
            if until is not None and until() and not self.exited():
                return None
            codes = [r.poll() for r in self.ranks]
            if all(c is not None for c in codes):
                kind = EndKind.DONE if all(c == 0 for c in codes) else EndKind.RANK_EXIT
                return self._end(kind, attempt, codes)
            if any(c not in (None, 0) for c in codes):
                return self._after_rank_exit(attempt, codes)
            progress = self.progress()
            running = [p for p in progress.values() if p.running]
            if running and time.time() - min(p.at for p in running) > self.timeout:
                return self._stop_with_stacks(EndKind.HANG, attempt, progress)
            if not progress and time.time() - started > self.startup_timeout:
                return self._stop_with_stacks(EndKind.START, attempt, progress)
            time.sleep(_POLL)

    def _after_rank_exit(self, attempt: int, codes: list) -> WorldEnd:
        """A rank exited with an error: a peer that raised too finishes on its own within seconds; the
        ones still running after that are waiting inside a collective, so take their stacks and stop them."""
        broken = any(c == RankExit.BROKEN for c in codes)
        deadline = time.time() + (0.0 if broken else _EXIT_GRACE)
        while time.time() < deadline and any(r.poll() is None for r in self.ranks):
            time.sleep(_POLL)
        if all(r.poll() is not None for r in self.ranks):
            return self._end(EndKind.RANK_EXIT, attempt, [r.poll() for r in self.ranks])
        return self._stop_with_stacks(EndKind.RANK_EXIT, attempt, self.progress())

    def _stop_with_stacks(self, kind: EndKind, attempt: int, progress: dict[int, RankProgress]) -> WorldEnd:
        live = [i for i, r in enumerate(self.ranks) if r.poll() is None]
        for i in live:
            self.ranks[i].signal(signal.SIGUSR1)
        time.sleep(_STACK_WAIT if live else 0.0)
        stacks = {i: _read(self.rundir.stacks(i)) for i in live}
        codes = [r.poll() for r in self.ranks]
        self.stop()
        return self._end(kind, attempt, codes, stacks, progress)

    def _end(self, kind: EndKind, attempt: int, codes: list, stacks=None, progress=None) -> WorldEnd:
        logs = {i: _tail(self.rundir.log(attempt, i)) for i, c in enumerate(codes) if c not in (0, RankExit.BROKEN)}
        return WorldEnd(kind, attempt, codes, stacks or {}, progress if progress is not None else self.progress(), logs)

    def exited(self) -> bool:
        """Some rank process has ended (a world that lost a rank cannot run another case)."""
        return any(r.poll() is not None for r in self.ranks)

    def progress(self) -> dict[int, RankProgress]:
        """Each rank's progress file, by rank, where one has been written (and read whole)."""
        found = {}
        for rank in range(self.nproc):
            progress = RankProgress.from_json(read_json(self.rundir.progress(rank)))
            if progress is not None:
                found[rank] = progress
        return found

    def stop(self) -> None:
        """Kill every rank's whole session; safe to call twice."""
        for rank in self.ranks:
            if rank.poll() is None:
                rank.kill()
        for rank in self.ranks:
            rank.wait(10)
        self.ranks = []


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as handle:
            return handle.read()
    except OSError:
        return ""


def _tail(path: str, lines: int = 25) -> str:
    text = [l for l in _read(path).splitlines() if l.strip() and "Warning" not in l]
    return "\n".join(text[-lines:])
