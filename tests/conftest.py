import pytest
from hypothesis import settings

from tests.support import run_paracheck

# Two cores shared with rank processes: wall-clock deadlines measure the machine, not the code.
settings.register_profile("paracheck", deadline=None)
settings.load_profile("paracheck")


@pytest.fixture(scope="session")
def default_run(tmp_path_factory):
    """Every control on every fixture x every 4-rank layout, base inputs, in one launch (the variants have
    their own run: see test_variants)."""
    return run_paracheck(["--controls", "--variants", "base"], tmp_path_factory.mktemp("default"))
