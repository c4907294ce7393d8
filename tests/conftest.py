import multiprocessing.forkserver  # noqa: F401
import multiprocessing.popen_forkserver  # noqa: F401

import pytest
from hypothesis import settings

import paracheck.launch.launcher  # noqa: F401
from tests.support import run_paracheck

# The session's one fork server lives in the modules above: imported here, before any test, they are not among
# the modules an in-process pytester run drops on exit (which would strand the server and start a second).

# Two cores shared with rank processes: wall-clock deadlines measure the machine, not the code.
settings.register_profile("paracheck", deadline=None)
settings.load_profile("paracheck")


@pytest.fixture(scope="session")
def default_run(tmp_path_factory):
    """Every control on the first five fixtures (both plans, TP only, CP only) x every 4-rank layout, base
    inputs, in one launch. The other five fixtures and the variants have their own runs (test_run.py).
    Not localized: rerunning its 156 detected controls with hooks took 72 of its 171 case-seconds, and the
    localization has runs of its own (test_localize_controls.py)."""
    return run_paracheck(["--controls", "--variants", "base", "--models", "flux,flux2,qwenimage,wan,ltx"],
                         tmp_path_factory.mktemp("default"), switches={"PARACHECK_LOCALIZE": "0"})


@pytest.fixture(scope="session")
def html_run(tmp_path_factory):
    """A tiny real run (one control, 2 ranks) that writes its JSON and HTML reports, for the HTML tests."""
    tmp = tmp_path_factory.mktemp("html")
    run = run_paracheck(["--models", "flux", "--layouts", "tp2", "--nproc", "2", "--variants", "base", "--controls",
                         "--only-control", "backward-only", "--html", str(tmp / "run.html")], tmp)
    assert run.code == 0 and run.report, run.out
    return run, tmp / "run.html"


def pytest_collection_modifyitems(items):
    """Under pytest-xdist (`-n 2 --dist loadgroup`, what .ci/run runs), the tests that read one session run share a
    worker: the run is then launched once, not once per worker."""
    for item in items:
        shared = [name for name in ("default_run", "html_run") if name in getattr(item, "fixturenames", ())]
        if shared:
            item.add_marker(pytest.mark.xdist_group(shared[0]))
