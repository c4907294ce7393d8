import pytest
from hypothesis import settings

from tests.support import run_paracheck

# Two cores shared with rank processes: wall-clock deadlines measure the machine, not the code.
settings.register_profile("paracheck", deadline=None)
settings.load_profile("paracheck")


@pytest.fixture(scope="session")
def default_run(tmp_path_factory):
    """The default job with every control: all fixtures x every 4-rank layout, in one launch."""
    return run_paracheck(["--controls"], tmp_path_factory.mktemp("default"))
