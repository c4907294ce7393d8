"""Running the real `paracheck` command from the kit's tests, and reading its JSON report."""

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPECS = os.path.join(ROOT, "tests", "specs.py")
#: --timeout of the runs whose cases hang on purpose: each hang waits it out once, so it is kept short. It is
#: counted from a case's start on each rank (a world's start is not), and the healthy cases that share a world
#: with a hang take well under a second each here.
HANG_TIMEOUT = 6


@dataclass
class Run:
    code: int
    out: str
    report: dict
    tmpdir: str

    def case(self, model, layout, control=None, variant="base"):
        found = [c for c in self.report["cases"] if c["model"] == model and c["layout"] == layout
                 and c["control"] == control and c.get("variant", "base") == variant]
        assert len(found) == 1, (model, layout, control, variant, len(found))
        return found[0]

    def check(self, model, layout, check_id, control=None, variant="base"):
        return next(c for c in self.case(model, layout, control, variant)["checks"] if c["id"] == check_id)


@dataclass
class WatchedRun(Run):
    """A run in a `paracheck` process of its own, with what it started: `seen`, every process of the run alive at
    some point while it ran, and `left`, those alive once it had exited (pid -> command line)."""
    seen: dict = field(default_factory=dict)
    left: dict = field(default_factory=dict)


def run_paracheck(args, tmp_path, timeout=900, env=None, command="run", switches=None) -> Run:
    """A real `paracheck run` (or `command`), with its own TMPDIR so leftovers are visible.

    It runs in this process, the way a user's `main()` call would, so its ranks fork from the session's fork
    server, which imported torch and the libraries once (a command of its own pays ~6 s of imports per
    launch on this 2-core machine); `env` gives it a process of its own (and `timeout`). `switches`: run
    switches (`launch.protocol.RUN_SWITCHES`, e.g. PARACHECK_LOCALIZE) set for this run alone."""
    with _environment(switches or {}):
        return _run(args, tmp_path, timeout, env, command)


@contextlib.contextmanager
def _environment(values: dict):
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _run(args, tmp_path, timeout, env, command) -> Run:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir(exist_ok=True)
    report = tmp_path / "report.json"
    argv = [command, *args, "--report-json", str(report)]
    if env:
        env = dict(os.environ, TMPDIR=str(tmpdir), **(env or {}))
        proc = subprocess.run([sys.executable, "-m", "paracheck", *argv], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=timeout)
        code, out = proc.returncode, proc.stdout + proc.stderr
    else:
        code, out = _in_process(argv, str(tmpdir))
    data = json.loads(report.read_text()) if report.exists() else {}
    return Run(code, out, data, str(tmpdir))


def _in_process(argv: list[str], tmpdir: str) -> tuple[int, str]:
    import multiprocessing.util

    from paracheck.cli.main import main

    # The fork server's socket folder is made once per process, in the temp folder of the moment: make it
    # before this run's TMPDIR stands in, so it is not this run's leftover.
    multiprocessing.util.get_temp_dir()
    out, saved = io.StringIO(), tempfile.tempdir
    tempfile.tempdir = tmpdir
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                code = main(argv)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        tempfile.tempdir = saved
    return code, out.getvalue()


class Watched:
    """`paracheck run ARGS` in a process of its own, started at once and watched from a thread until it exits:
    every process carrying this run's mark in its environment (its ranks, the fork server and its forks, the
    resource tracker) is recorded while it runs, and whatever is still alive once it has exited. `result()` waits
    for it; `deadline` guards against a run that never exits and measures nothing."""

    def __init__(self, args, tmp_path, deadline: float = 600):
        self.mark, self.tmpdir, self.report = uuid.uuid4().hex, tmp_path / "tmp", tmp_path / "report.json"
        self.tmpdir.mkdir(exist_ok=True)
        self.log = open(tmp_path / "out.txt", "w+")  # a file, not a pipe: nobody reads while it runs
        env = dict(os.environ, PARACHECK_TEST_MARK=self.mark, TMPDIR=str(self.tmpdir))
        self.proc = subprocess.Popen([sys.executable, "-m", "paracheck", "run", *args, "--report-json",
                                      str(self.report)], cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.seen: dict[int, str] = {}
        self.stop = time.monotonic() + deadline
        self.watcher = threading.Thread(target=self._watch, daemon=True)
        self.watcher.start()

    def _watch(self) -> None:
        while self.proc.poll() is None and time.monotonic() < self.stop:
            self.seen.update(marked(self.mark))
            time.sleep(0.2)

    def result(self) -> WatchedRun:
        self.watcher.join()
        if self.proc.poll() is None:
            out = self._out()  # before close() closes the log
            self.close()
            raise AssertionError(f"paracheck did not exit in time: {out}")
        data = json.loads(self.report.read_text()) if self.report.exists() else {}
        left, out = marked(self.mark), self._out()
        self.log.close()
        return WatchedRun(self.proc.returncode, out, data, str(self.tmpdir), dict(self.seen), left)

    def close(self) -> None:
        """Ends the run and what it started, if still running (a session stopped before reading it)."""
        if self.proc.poll() is None:
            for pid in [self.proc.pid, *marked(self.mark)]:
                with contextlib.suppress(OSError):
                    os.kill(pid, 9)
            self.proc.wait()
        self.log.close()

    def _out(self) -> str:
        self.log.seek(0)
        return self.log.read()


def marked(mark: str) -> dict[int, str]:
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


def script(name: str, folder: str = "scripts"):
    """FOLDER/NAME.py of the repository (scripts/, benchmarks/, examples/: no packages) loaded as a module, for
    tests of their pure parts."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), folder, f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
