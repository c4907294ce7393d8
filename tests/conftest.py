import pytest
from hypothesis import settings

from tests.support import run_paracheck

# Two cores shared with rank processes: wall-clock deadlines measure the machine, not the code.
settings.register_profile("paracheck", deadline=None)
settings.load_profile("paracheck")


@pytest.fixture(scope="session")
def default_run(tmp_path_factory):
    """Every control on the first five fixtures (both plans, TP only, CP only) x every 4-rank layout, base
    inputs, in one launch. The other five fixtures and the variants have their own runs (test_run.py)."""
    return run_paracheck(["--controls", "--variants", "base", "--models", "flux,flux2,qwenimage,wan,ltx"],
                         tmp_path_factory.mktemp("default"))
