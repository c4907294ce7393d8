"""scripts/ring_soak.py's heap-checking guard: `MALLOC_CHECK_` without libc_malloc_debug preloaded checks nothing on
glibc >= 2.34, and the soak must refuse to run so rather than pass for a checked one (docs/ci.md, "The ring crash")."""

import pytest

from tests.support import script


def _soak():
    return script("ring_soak")


def test_malloc_check_without_the_debug_library_is_refused(monkeypatch):
    soak = _soak()
    if soak.malloc_debug_state()[0]:
        pytest.skip("this process runs with libc_malloc_debug preloaded")
    monkeypatch.setenv("MALLOC_CHECK_", "3")
    with pytest.raises(SystemExit, match="not preloaded"):
        soak._check_malloc_debug(1)
    monkeypatch.delenv("MALLOC_CHECK_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.check=3")
    with pytest.raises(SystemExit, match="not preloaded"):
        soak._check_malloc_debug(1)


def test_no_check_asked_runs_unchecked_and_says_so(monkeypatch, capsys):
    soak = _soak()
    if soak.malloc_debug_state()[0]:
        pytest.skip("this process runs with libc_malloc_debug preloaded")
    monkeypatch.delenv("MALLOC_CHECK_", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    soak._check_malloc_debug(0)
    assert "heap checking: off" in capsys.readouterr().out
