import pytest

from tests.support import run_paracheck


@pytest.fixture(scope="session")
def default_run(tmp_path_factory):
    """The default job with every control: all fixtures x every 4-rank layout, in one launch."""
    return run_paracheck(["--controls"], tmp_path_factory.mktemp("default"))
