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
