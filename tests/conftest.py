import json
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _use_checkout_fixtures():
    """Make `paracheck.fixtures` this checkout's fixtures/ for the in-process tests.

    pyproject maps it there, but an editable install of another checkout maps it to that one's, and a
    PYTHONPATH pointing here supplies `paracheck` but not `paracheck.fixtures`. (Ranks started in
    subprocesses import what the installed mapping names.)"""
    import importlib.util

    path = os.path.join(ROOT, "fixtures", "__init__.py")
    found = importlib.util.find_spec("paracheck.fixtures")
    if found is not None and found.origin and os.path.realpath(found.origin) == os.path.realpath(path):
        return
    spec = importlib.util.spec_from_file_location("paracheck.fixtures", path,
                                                  submodule_search_locations=[os.path.dirname(path)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["paracheck.fixtures"] = module
    spec.loader.exec_module(module)
    import paracheck

    paracheck.fixtures = module


_use_checkout_fixtures()


@dataclass
class Run:
    code: int
    out: str
    report: dict
    tmpdir: str

    def case(self, model, layout, control=None):
        found = [c for c in self.report["cases"]
                 if c["model"] == model and c["layout"] == layout and c["control"] == control]
        assert len(found) == 1, (model, layout, control)
        return found[0]

    def check(self, model, layout, check_id, control=None):
        return next(c for c in self.case(model, layout, control)["checks"] if c["id"] == check_id)


def run_paracheck(args, tmp_path, timeout=900) -> Run:
    """A real `paracheck run` in a subprocess, with its own TMPDIR so leftovers are visible."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir(exist_ok=True)
    report = tmp_path / "report.json"
    env = dict(os.environ, TMPDIR=str(tmpdir))
    proc = subprocess.run([sys.executable, "-m", "paracheck", "run", *args, "--report-json", str(report)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    data = json.loads(report.read_text()) if report.exists() else {}
    return Run(proc.returncode, proc.stdout + proc.stderr, data, str(tmpdir))


@pytest.fixture(scope="session")
def default_run(tmp_path_factory):
    """The default job with every control: all fixtures x every 4-rank layout, in one launch."""
    return run_paracheck(["--controls"], tmp_path_factory.mktemp("default"))
