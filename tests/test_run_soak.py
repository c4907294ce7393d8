"""scripts/run_soak.py's pure parts: each run's environment really turns glibc's heap checks on, its output's heap
and signal lines are found, a run's line names its signal and its error cases, and its leftover processes are found
by their tag and killed, and one without the debug library is seen unchecked (docs/ci.md, "The ring crash")."""

import datetime
import os
import subprocess

from tests.support import script


def _soak():
    return script("run_soak")


def test_each_run_preloads_the_debug_library_with_the_check_on():
    soak = _soak()
    env = soak.child_env("pair00-a", {"LD_PRELOAD": "/x/other.so", "PATH": "/bin"})
    assert env["LD_PRELOAD"].split() == [soak.DEBUG_LIB, "/x/other.so"]
    assert env["MALLOC_CHECK_"] == "3" and env["PYTHONFAULTHANDLER"] == "1" and env[soak.TAG] == "pair00-a"


def test_a_run_line_names_its_signal_errors_and_heap_messages():
    soak = _soak()
    output = "12 passed\nmalloc(): unaligned tcache chunk detected\nrank 2 died\nFatal Python error: Aborted\nok\n"
    report = {"summary": {"passed": 1, "errors": 1},
              "cases": [{"id": "helios/r4", "status": "error"}, {"id": "flux/tp4", "status": "passed"}]}
    record = soak.run_record("pair00-a", -6, 12.34, output, report, 0)
    assert record["signal"] == "SIGABRT" and record["errors"] == ["helios/r4"] and record["seconds"] == 12.3
    assert record["heap"] == ["malloc(): unaligned tcache chunk detected", "Fatal Python error: Aborted"]
    clean = soak.run_record("pair00-b", 0, 1.0, "60 passed, 25 skipped\n", None, 0)
    assert clean["signal"] is None and clean["heap"] == [] and clean["errors"] == [] and clean["summary"] is None


def test_a_process_left_by_a_run_is_found_by_its_tag_and_killed():
    soak = _soak()
    # without the preload even where the suite itself runs under it (a checked run of the suite, docs/ci.md)
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"} | {soak.TAG: f"test-{os.getpid()}"}
    proc = subprocess.Popen(["sleep", "30"], env=env)
    try:
        assert soak.tagged(f"test-{os.getpid()}") == [proc.pid]
        seen = {}
        soak.sample_checked(f"test-{os.getpid()}", seen)
        assert seen == {proc.pid: False}  # started without the preload: unchecked, and said so
        assert soak.kill_tagged(f"test-{os.getpid()}") == 1
        assert proc.wait(timeout=5) == -9
    finally:
        proc.kill()


def test_a_stop_time_past_midnight_is_tomorrows():
    soak = _soak()
    utc = datetime.timezone.utc
    late = datetime.datetime(2026, 12, 4, 23, 25, 38, tzinfo=utc)
    assert soak._stop_time("00:25", late) == datetime.datetime(2026, 12, 5, 0, 25, tzinfo=utc).timestamp()
    assert soak._stop_time("23:40", late) == datetime.datetime(2026, 12, 4, 23, 40, tzinfo=utc).timestamp()
    assert soak._stop_time(None, late) == float("inf")
