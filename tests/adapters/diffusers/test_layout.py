"""diffusers layouts and their mesh math: pure, property-tested."""

import pytest
from hypothesis import given, strategies as st

from tests import strategies
from paracheck.adapters.diffusers.layout import (DiffusersLayout, backend_problems, fit_heads, head_multiple, layouts_for,
                                                 parse_layouts)
from paracheck.domain.backends import get_backend
from paracheck.domain.layout import LayoutError

layouts = strategies.layouts()


@given(layouts)
def test_name_round_trips(layout):
    assert DiffusersLayout.parse(layout.name, layout.order) == layout


@given(layouts)
def test_coords_are_a_bijection(layout):
    seen = {tuple(layout.coords(r).values()) for r in range(layout.world)}
    assert len(seen) == layout.world
    for rank in range(layout.world):
        assert layout.rank_of(layout.coords(rank)) == rank


@given(layouts, st.sampled_from([("tp",), ("ring", "ulysses"), ("ring",), ("ulysses",)]))
def test_groups_partition_the_world(layout, dims):
    groups = layout.groups(dims)
    flat = sorted(r for g in groups for r in g)
    assert flat == list(range(layout.world))
    size = 1
    for d in dims:
        size *= getattr(layout, d)
    assert all(len(g) == size for g in groups)


@given(layouts)
def test_fastest_dimension_is_contiguous(layout):
    fast = ("ring", "ulysses") if layout.order == "cp-fastest" else ("tp",)
    for group in layout.groups(fast):
        assert group == list(range(group[0], group[0] + len(group)))


@given(layouts)
def test_tp_and_cp_groups_meet_in_one_rank(layout):
    for rank in range(layout.world):
        assert set(layout.tp_group(rank)) & set(layout.cp_group(rank)) == {rank}


def test_default_order_puts_cp_runs_contiguous():
    layout = DiffusersLayout.parse("tp2xu2")
    assert layout.groups(("ring", "ulysses")) == [[0, 1], [2, 3]]
    assert layout.groups(("tp",)) == [[0, 2], [1, 3]]
    assert DiffusersLayout.parse("tp2xu2", "tp-fastest").groups(("tp",)) == [[0, 1], [2, 3]]


@given(st.integers(1, 200), layouts)
def test_fit_heads_is_the_smallest_divisible_count(heads, layout):
    fitted = fit_heads(heads, layout)
    assert fitted >= heads and fitted % head_multiple(layout) == 0
    assert fitted - head_multiple(layout) < heads


@given(st.integers(2, 64))
def test_layouts_for_lists_every_factorization_once(world):
    found = layouts_for(world)
    assert len(found) == len(set(found))
    assert all(l.world == world for l in found)
    expected = sum(1 for t in range(1, world + 1) for r in range(1, world + 1) if world % (t * r) == 0)
    assert len(found) == expected


def test_four_ranks_give_the_contract_layouts():
    names = {l.name for l in layouts_for(4)}
    assert {"tp4", "u4", "r4", "tp2xu2", "tp2xr2", "r2xu2"} == names


@pytest.mark.parametrize("text, fragment", [
    ("tp2xq2", "part 'q2'"),
    ("u2xtp2", "order tp, r, u"),
    ("tp2xtp2", "appears twice"),
    ("", "layout ''"),
    ("tp0", "must be >= 1"),
])
def test_bad_layouts_name_the_rule(text, fragment):
    with pytest.raises(LayoutError, match=fragment):
        DiffusersLayout.parse(text)


def test_world_mismatch_names_both_sizes():
    with pytest.raises(LayoutError, match="world size is 8.*--nproc is 4"):
        parse_layouts("tp2xu4", 4)


def test_bad_order_is_refused():
    with pytest.raises(LayoutError, match="--order"):
        DiffusersLayout(2, 1, 1, "random")


@given(strategies.layouts(8))
def test_gloo_takes_every_layout(layout):
    """Ring too: on CPU it runs with paracheck's attention op that returns the log-sum-exp."""
    assert backend_problems(get_backend("gloo"), layout) == []


@given(strategies.layouts(8))
def test_neuron_alltoall_group_sizes(layout):
    problems = " ".join(backend_problems(get_backend("neuron"), layout))
    u = layout.ulysses
    bad_size = u > 1 and u not in (4, 8, 16) and u % 32 != 0
    assert ("ulysses degree" in problems) == bad_size
    assert ("contiguous" in problems) == (u > 1 and layout.tp > 1 and layout.order == "tp-fastest")


def test_nccl_accepts_ring():
    assert backend_problems(get_backend("nccl"), DiffusersLayout.parse("tp2xr2")) == []
