"""`--shard I/N` slices: a partition of the cases, deterministic, balanced, groups kept whole."""

import pytest
from hypothesis import given, strategies as st

from paracheck.domain.sharding import ShardError, parse_shard, shard, slices


@given(st.lists(st.integers(0, 6)), st.integers(1, 7))
def test_the_slices_partition_the_cases_and_keep_each_group_in_one(groups, count):
    parts = slices(groups, count, group=lambda g: g)
    flat = sorted(i for part in parts for i in part)
    assert flat == list(range(len(groups)))  # every case once
    for part in parts:
        for other in parts:
            if part is not other:
                assert not {groups[i] for i in part} & {groups[i] for i in other}
    assert parts == slices(list(groups), count, group=lambda g: g)  # deterministic


@given(st.integers(0, 40), st.integers(1, 7))
def test_ungrouped_slices_differ_in_size_by_at_most_one(n, count):
    sizes = [len(s) for s in slices(list(range(n)), count)]
    assert max(sizes) - min(sizes) <= 1
    assert sum((shard(list(range(n)), i, count) for i in range(1, count + 1)), []) != [] or n == 0


@pytest.mark.parametrize("text", ["0/2", "3/2", "1", "a/b", "1/0"])
def test_bad_shards_name_the_rule(text):
    with pytest.raises(ShardError, match="--shard"):
        parse_shard(text)


def test_a_good_shard_parses():
    assert parse_shard("2/5") == (2, 5)
