"""A requirement of the installed transformers that its loading asks for (transformers 5.25's `kernels`): one line
naming the package, the range, what is installed and what asks, before any rank starts (exit 2); nothing where the
release does not require it, where it is in range, or where the library's switch turns the asking off.

The installs are real distributions' metadata (dist-info folders) put first on the path, as a venv with another
transformers or kernels would be; `importlib.metadata` reads them as it reads the installed ones."""

import os
import subprocess
import sys

import pytest

from paracheck.adapters.transformers import requirements
from tests.support import ROOT

REQUIRES_525 = "Requires-Dist: kernels<0.20,>=0.19.1\nRequires-Dist: kernels<0.20,>=0.19.1; extra == \"kernels\"\n"
REQUIRES_524 = "Requires-Dist: kernels<0.19,>=0.18.2; extra == \"kernels\"\n"


def _installs(folder, transformers: str, requires: str, kernels: str | None) -> str:
    """dist-info folders for transformers (with its Requires-Dist lines) and, unless None, kernels."""
    for name, version, extra in (("transformers", transformers, requires), ("kernels", kernels, "")):
        if version is not None:
            info = folder / f"{name}-{version}.dist-info"
            info.mkdir()
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{extra}")
    return str(folder)


@pytest.fixture
def installed(tmp_path, monkeypatch):
    def install(transformers, requires, kernels):
        monkeypatch.syspath_prepend(_installs(tmp_path, transformers, requires, kernels))
    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    return install


def test_kernels_out_of_range_is_one_line_naming_package_range_install_and_asker(installed):
    installed("5.25.0", REQUIRES_525, "0.18.0")
    line = requirements.missing()
    assert line == ("transformers 5.25.0 requires kernels<0.20,>=0.19.1 (0.18.0 installed), asked for by its "
                    "from_pretrained (hub kernels are on by default; USE_HUB_KERNELS=0 turns them off), which every "
                    "transformers case loads its model with: pip install 'kernels<0.20,>=0.19.1'")


@pytest.mark.parametrize("transformers, requires, kernels, switch", [
    ("5.25.0", REQUIRES_525, "0.19.1", None),  # in range
    ("5.25.0", REQUIRES_525, "0.18.0", "0"),  # the library's switch: its loading asks for no hub kernels
    ("5.24.0", REQUIRES_524, "0.18.0", None),  # kernels only in an extra: loading does not ask
])
def test_nothing_is_refused_where_loading_does_not_ask_or_finds_it(installed, monkeypatch, transformers, requires,
                                                                   kernels, switch):
    installed(transformers, requires, kernels)
    if switch is not None:
        monkeypatch.setenv("USE_HUB_KERNELS", switch)
    assert requirements.missing() is None


def test_the_run_exits_2_with_the_one_line_before_any_rank(tmp_path):
    """The default run (transformers' fixtures among its cases) on such an install: exit 2 and one line, in about
    the time the command takes to parse its options (no rank, no torch)."""
    path = _installs(tmp_path, "5.25.0", REQUIRES_525, "0.18.0")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([path, ROOT]), TMPDIR=str(tmp_path))
    env.pop("USE_HUB_KERNELS", None)
    proc = subprocess.run([sys.executable, "-m", "paracheck", "run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and "requires kernels<0.20,>=0.19.1 (0.18.0 installed)" in lines[0], lines
    assert not [n for n in os.listdir(tmp_path) if n.startswith("paracheck-")]  # no run folder: no rank started
