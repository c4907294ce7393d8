"""What a rank frees after each case: the case's objects at once, cyclic garbage from earlier cases within
`THAW_EVERY` cases (the survivors of a case are frozen, so the collector stops re-walking them)."""

import gc
import weakref

from paracheck.rank import worker


class _Node:
    pass


def test_a_cycle_that_dies_while_frozen_is_freed_at_the_next_thaw(monkeypatch):
    monkeypatch.setattr(worker, "_released", 0)
    kept = _Node()
    kept.self = kept  # a cycle: only the collector frees it
    alive = weakref.ref(kept)
    try:
        worker._release_memory()  # it outlives this case, so it is frozen
        del kept
        worker._release_memory()
        assert alive() is not None, "frozen objects are not walked: a cycle that died stays until the next thaw"
        for _ in range(worker.THAW_EVERY - 2):
            worker._release_memory()
        assert alive() is None, f"not freed after {worker.THAW_EVERY} cases"
    finally:
        gc.unfreeze()


def test_a_cycle_made_and_dropped_within_a_case_is_freed_by_its_own_release(monkeypatch):
    monkeypatch.setattr(worker, "_released", 0)
    node = _Node()
    node.self = node
    alive = weakref.ref(node)
    del node
    try:
        worker._release_memory()
        assert alive() is None
    finally:
        gc.unfreeze()
