"""Running the real `paracheck` command from the kit's tests, and reading its JSON report."""

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPECS = os.path.join(ROOT, "tests", "specs.py")


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
