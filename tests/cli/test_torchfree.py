"""The command line answers help, topology and usage errors without importing torch."""

import subprocess
import sys

import pytest

from tests.support import ROOT

PROBE = """
import sys
from paracheck.cli.main import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', code)
"""


@pytest.mark.parametrize("argv, code", [
    (["--help"], 0),
    (["run", "--help"], 0),
    (["topology", "--backend", "neuron", "--world", "16", "--heads", "24"], 0),
    (["run", "--layouts", "tp2xq2"], 2),
    (["run", "--layouts", "tp2xu4"], 2),
    (["run", "--backend", "mpi"], 2),
    (["run", "--dtype", "fp8"], 2),
    (["run", "--models", "sd3"], 2),
    (["run", "--known-failures", "/no/such.toml"], 2),
    (["report", "/no/such.json", "--html", "/tmp/paracheck-never-written.html"], 2),
])
def test_no_torch_import(argv, code):
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=ROOT, capture_output=True, text=True).stdout
    assert out.split()[-2:] == ["NO-TORCH", str(code)], out
