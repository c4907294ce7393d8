"""What a rank frees after each case: the case's objects at once, cyclic garbage from earlier cases within
`THAW_EVERY` cases or `THAW_GROWTH_MB` of growth (the survivors of a case are frozen, so the collector stops
re-walking them)."""

import gc
import weakref

from paracheck.rank import worker


class _Node:
    pass


def test_a_cycle_that_dies_while_frozen_is_freed_at_the_next_thaw(monkeypatch):
    monkeypatch.setattr(worker, "_released", 0)
    monkeypatch.setattr(worker, "_rss_after_thaw", float("inf"))  # the count alone decides here
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
    monkeypatch.setattr(worker, "_rss_after_thaw", float("inf"))
    node = _Node()
    node.self = node
    alive = weakref.ref(node)
    del node
    try:
        worker._release_memory()
        assert alive() is None
    finally:
        gc.unfreeze()


def test_kept_cycles_dropped_while_frozen_are_freed_once_memory_grows(monkeypatch):
    """A rank that keeps one big object with a cycle per case (a user's reference model holding a bound
    method, say) and drops the last one: resident memory grows case by case until a thaw frees them, long
    before `THAW_EVERY` cases."""
    monkeypatch.setattr(worker, "_released", 0)
    monkeypatch.setattr(worker, "THAW_GROWTH_MB", 100.0)
    monkeypatch.setattr(worker, "_rss_after_thaw", worker._rss_mb())
    alive, kept = [], None
    try:
        for _ in range(4):
            kept = _Node()
            kept.self, kept.payload = kept, bytearray(b"x") * (64 << 20)  # 64 MiB, resident
            alive.append(weakref.ref(kept))
            worker._release_memory()
        # 64 MiB more per case: past 100 MiB of growth at cases 2 and 4, and each thaw frees what was dropped.
        assert [a() is None for a in alive] == [True, True, True, False], [a() is None for a in alive]
    finally:
        kept = None
        gc.unfreeze()
        gc.collect()


def test_the_first_case_of_a_rank_does_not_thaw_what_the_fork_server_imported(monkeypatch):
    """Growth is counted from the memory a rank starts with (`started_at`, which `worker.main` calls after its
    freeze), not from 0: counted from 0, every world's first case thawed everything imported for one full
    collection (1.1 to 1.3 s a rank, measured)."""
    thawed = []
    monkeypatch.setattr(worker, "_released", 0)
    monkeypatch.setattr(worker, "_rss_after_thaw", 0.0)
    monkeypatch.setattr(worker.gc, "unfreeze", lambda: thawed.append(True))
    try:
        worker._release_memory()
        assert thawed == [True]  # the fault: from 0, a rank of any size has grown past THAW_GROWTH_MB
        worker.started_at(worker._rss_mb())
        worker._release_memory()
        assert thawed == [True]
    finally:
        monkeypatch.undo()
        gc.unfreeze()
