"""`world.recent.Recent`: what a rank keeps across cases is computed once per key and bounded in count."""

from hypothesis import given
from hypothesis import strategies as st

from paracheck.world.recent import Recent


@given(st.lists(st.integers(0, 6), max_size=40), st.integers(1, 4))
def test_each_key_is_computed_once_while_kept_and_at_most_keep_are_held(keys, keep):
    recent, computed, lru = Recent(keep), [], []
    for key in keys:
        assert recent.get(key, lambda: computed.append(key) or key * 10) == key * 10
        if key not in lru:
            assert computed[-1] == key  # computed exactly when it was not among the `keep` most recently used
        lru = [k for k in lru if k != key] + [key]
        lru = lru[-keep:]
        assert len(recent._kept) <= keep
    assert len(computed) == sum(1 for i, k in enumerate(keys) if k not in _recent_before(keys[:i], keep))


def _recent_before(keys, keep):
    lru = []
    for key in keys:
        lru = [k for k in lru if k != key] + [key]
    return lru[-keep:]


def test_every_cache_is_registered_and_entering_another_world_drops_what_each_kept():
    from paracheck.world import recent

    one, two, worlds = Recent(2, "test one"), Recent(1, "test two"), [object(), object()]
    recent.enter(worlds[0])
    for key in range(5):
        one.get(key, lambda: key)
        two.get(key, lambda: key)
    assert (recent.held()["test one"], recent.held()["test two"]) == (2, 1)
    recent.enter(worlds[0])  # the same world: everything stays
    assert (len(one), len(two)) == (2, 1)
    recent.enter(worlds[1])
    assert (len(one), len(two)) == (0, 0) and recent.held()["test one"] == 0
    del one  # a cache dropped by its owner leaves the registry
    assert "test one" not in recent.held()


def test_the_least_recent_result_is_dropped_before_its_successor_is_computed():
    """A reference is never held beside the next one (one at most, as `LastReference` promised)."""
    kept = Recent(1, "test flat")
    kept.get("a", lambda: "a")
    assert kept.get("b", lambda: len(kept)) == 0  # nothing held while "b" is computed
