"""A TMPDIR too long for the fork server's socket: ranks still start, and without the fit the failure is real."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Start the fork server and one process through it, as the supervisor does for a rank; print the folder it used.
_START = """
import multiprocessing, multiprocessing.util, os, sys
if sys.argv[1] == "made":  # multiprocessing's folder made under the long TMPDIR before the run
    multiprocessing.util.get_temp_dir()
if sys.argv[1] in ("fit", "made"):
    from paracheck.launch.supervisor import _fit_server_socket
    _fit_server_socket()
process = multiprocessing.get_context("forkserver").Process(target=os.getpid)
process.start()
process.join(60)
print(process.exitcode, multiprocessing.util.get_temp_dir())
"""


def _start(tmp_path, how: str) -> subprocess.CompletedProcess:
    long = tmp_path / ("d" * max(1, 100 - len(str(tmp_path))))  # 100 characters and more: no room for the socket
    long.mkdir()
    return subprocess.run([sys.executable, "-c", _START, how], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, TMPDIR=str(long), PYTHONPATH=ROOT))


def test_a_long_tmpdir_moves_the_server_socket_to_a_short_folder(tmp_path):
    proc = _start(tmp_path, "fit")
    assert proc.returncode == 0, proc.stderr
    code, folder = proc.stdout.split()
    assert code == "0" and len(folder) < 40 and not os.path.exists(folder), proc.stdout  # removed at exit


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="CPython 3.14 falls back to a short folder itself")
def test_negative_control_without_the_fit_the_server_cannot_start(tmp_path):
    proc = _start(tmp_path, "plain")
    assert proc.returncode != 0 and "AF_UNIX path too long" in proc.stderr, proc.stderr


def test_a_folder_made_too_long_before_the_run_is_named_not_a_bare_oserror(tmp_path):
    proc = _start(tmp_path, "made")
    assert proc.returncode != 0 and "AF_UNIX" not in proc.stderr, proc.stderr
    assert "made before this run" in proc.stderr and "set TMPDIR to a shorter folder" in proc.stderr, proc.stderr
