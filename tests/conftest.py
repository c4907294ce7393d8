import multiprocessing.forkserver  # noqa: F401
import multiprocessing.popen_forkserver  # noqa: F401
import pathlib
import shutil
import tempfile

import pytest
from hypothesis import settings

import paracheck.launch.launcher  # noqa: F401
from paracheck.pytest.mixin import ParallelTesterMixin
from tests.suite_groups import SHARED_RUNS, group_of, worlds_at_once
from tests.support import HANG_TIMEOUT, SPECS, Watched, run_paracheck

# The session's one fork server lives in the modules above: imported here, before any test, they are not among
# the modules an in-process pytester run drops on exit (which would strand the server and start a second).

# Two cores shared with rank processes: wall-clock deadlines measure the machine, not the code.
settings.register_profile("paracheck", deadline=None)
settings.load_profile("paracheck")


@pytest.fixture
def one_rank_world(tmp_path):
    """A real one-rank gloo world in this process, for the parts that take a process group (no launched world)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def tp_mesh_of_one(one_rank_world):
    """A one-rank "tp" device mesh of that world: the TP styles' hooks, as on any mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))


@pytest.fixture(scope="session")
def default_run(tmp_path_factory):
    """Every control on the first five fixtures (both plans, TP only, CP only) x every 4-rank layout, base
    inputs, in one launch. The other five fixtures and the variants have their own runs (test_run.py).
    Not localized: rerunning its 156 detected controls with hooks took 72 of its 171 case-seconds, and the
    localization has runs of its own (test_localize_controls.py)."""
    return run_paracheck(["--controls", "--variants", "base", "--models", "flux,flux2,qwenimage,wan,ltx"],
                         tmp_path_factory.mktemp("default"), switches={"PARACHECK_LOCALIZE": "0"})


def _hung_args() -> list[str]:
    return ["--spec", f"{SPECS}:rank1_hangs", "--layouts", "u4,tp4", "--controls", "--timeout", str(HANG_TIMEOUT),
            "--known-failures", "none", "--quiet"]


_HUNG = pytest.StashKey()


def _start_hung(config) -> Watched:
    """The hanging run, started once per process and kept in the config's stash, so the session's end closes it
    whoever started it."""
    if _HUNG not in config.stash:
        config.stash[_HUNG] = Watched(_hung_args(), pathlib.Path(tempfile.mkdtemp(prefix="hung-run-")))
    return config.stash[_HUNG]


def pytest_collection_finish(session):
    """Where a test that reads `hung_run` will run, its run starts now, in the background: its ranks sit blocked
    through both timeouts, taking no CPU, so the waits pass while the tests before it run. (Under pytest-xdist a
    worker cannot tell which tests it will get: the fixture starts the run when first asked.)"""
    if not hasattr(session.config, "workerinput") and any(
            "hung_run" in getattr(item, "fixturenames", ()) for item in session.items):
        _start_hung(session.config)


def pytest_sessionfinish(session):
    started = session.config.stash.get(_HUNG, None)
    if started is not None:
        started.close()
        shutil.rmtree(started.tmpdir.parent, ignore_errors=True)


@pytest.fixture(scope="session")
def hung_run(request):
    """One `paracheck` process of its own, watched, whose every case hangs (rank 1 enters a collective no peer
    joins) on two layouts, with their controls: it ends on --timeout, exit 3. The hang tests read its report
    (`test_hang_cost`) and the processes it started (`test_reaper`): one wait per layout serves both."""
    return _start_hung(request.config).result()


@pytest.fixture(scope="session")
def pipeline_run(tmp_path_factory):
    """A real pipeline run (2 ranks): Flux's pipeline on u2 and tp2, its transformer loaded with a parallel_config
    from a checkpoint (sharded-load), with every pipeline control, and its HTML report; the pipeline tests and the
    browser test read it."""
    tmp = tmp_path_factory.mktemp("pipelines")
    run = run_paracheck(["--models", "flux-pipeline", "--layouts", "u2,tp2", "--nproc", "2", "--route", "sharded-load",
                         "--controls", "--html", str(tmp / "run.html")], tmp)
    assert run.code == 0 and run.report, run.out
    return run, tmp / "run.html"


@pytest.fixture(scope="session")
def html_run(tmp_path_factory):
    """A tiny real run (one control, 2 ranks) that writes its JSON and HTML reports, for the HTML tests."""
    tmp = tmp_path_factory.mktemp("html")
    run = run_paracheck(["--models", "flux", "--layouts", "tp2", "--nproc", "2", "--variants", "base", "--controls",
                         "--only-control", "backward-only", "--html", str(tmp / "run.html")], tmp)
    assert run.code == 0 and run.report, run.out
    return run, tmp / "run.html"


@pytest.hookimpl(tryfirst=True)  # before `-m "not slow"` deselects by the markers
def pytest_collection_modifyitems(items):
    """The tests that read a session run, and every test of a mixin class, launch worlds: they are `slow`. Under
    pytest-xdist (`-n 2 --dist loadgroup`, the README's command) every slow test is in one group, `worlds`, so one
    worker runs the worlds one after another and the session runs are launched once; the other worker takes the
    in-process tests, single-threaded, which fill the core a world leaves idle, and the hanging run's readers,
    whose ranks sit blocked. Two worlds at once are not run by default: they slow each other's collectives, and in
    one of three suites that ran them so, two ranks of ring layouts died of heap corruption (docs/ci.md);
    `PARACHECK_SUITE_WORLDS=2` allows them (tests/suite_groups.py)."""
    worlds = worlds_at_once()
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        cls = getattr(item, "cls", None)
        if any(name in fixtures for name in SHARED_RUNS) or (cls is not None and issubclass(cls, ParallelTesterMixin)):
            item.add_marker(pytest.mark.slow)
        group = group_of(fixtures, item.nodeid.split("::")[0], item.get_closest_marker("slow") is not None, worlds)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(autouse=True)
def _the_fast_tier_starts_no_world(request, monkeypatch):
    """A test without the `slow` marker that launches a world fails, naming the marker: the fast tier
    (`-m "not slow"`) stays in process."""
    if request.node.get_closest_marker("slow") is None:
        def refuse(self, cases):
            pytest.fail(f"{request.node.nodeid} launches a world of ranks: mark it `slow` (docs/ci.md)")
        monkeypatch.setattr(paracheck.launch.launcher.Launcher, "run", refuse)
