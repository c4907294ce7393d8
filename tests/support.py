"""Running the real `paracheck` command from the kit's tests, and reading its JSON report."""

import json
import os
import subprocess
import sys
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


def run_paracheck(args, tmp_path, timeout=900, env=None, command="run") -> Run:
    """A real `paracheck run` (or `command`) in a subprocess, with its own TMPDIR so leftovers are visible."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir(exist_ok=True)
    report = tmp_path / "report.json"
    env = dict(os.environ, TMPDIR=str(tmpdir), **(env or {}))
    proc = subprocess.run([sys.executable, "-m", "paracheck", command, *args, "--report-json", str(report)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    data = json.loads(report.read_text()) if report.exists() else {}
    return Run(proc.returncode, proc.stdout + proc.stderr, data, str(tmpdir))
