"""Which pytest-xdist group each test of the suite runs in: one world at a time (the default) or two
(`PARACHECK_SUITE_WORLDS=2`, opt-in; docs/ci.md, "Two workers, one world at a time").

Under `-n 2 --dist loadgroup` a group runs on one worker, in order. One world at a time puts every slow test in one
group, `worlds`. Two at once splits the slow tests by the world they launch, so the two workers may each run one:
the readers of a session run share that run's group (it is launched once, on the worker that holds the group), and
every other slow test goes with its module (its module- and class-scoped worlds, a mixin class's, launched once).
The hanging run's readers have their own group either way: its ranks sit blocked, costing no CPU.
"""

import os

ENV = "PARACHECK_SUITE_WORLDS"
#: The session runs (tests/conftest.py) and the group their readers share when two worlds are allowed. The two
#: 2-rank report runs share one: the browser test reads both, so apart they could each be launched twice.
SHARED_RUNS = {"hung_run": "hung_run", "default_run": "default_run", "html_run": "reports",
               "pipeline_run": "reports"}


def worlds_at_once(environ=None) -> int:
    """How many worlds the suite may run at once: 1 unless the environment asks for 2; anything else is refused,
    so a typo does not silently run the default."""
    value = (os.environ if environ is None else environ).get(ENV, "1").strip() or "1"
    if value not in ("1", "2"):
        raise ValueError(f"{ENV}={value!r}: 1 (one world at a time, the default) or 2")
    return int(value)


def group_of(fixtures, module: str, slow: bool, worlds: int) -> str | None:
    """The xdist group of a test that reads `fixtures` (names), defined in `module` (its path), `slow` if it
    launches worlds; None: no group (an in-process test, scheduled freely)."""
    shared = [SHARED_RUNS[name] for name in SHARED_RUNS if name in fixtures]
    if "hung_run" in shared:
        return "hung_run"
    if not slow:
        return None
    if worlds == 1:
        return "worlds"
    return shared[0] if shared else f"worlds:{module}"
