import json
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
