"""The host's one layout concept: a grammar's degrees by name, validated, and the mesh, groups and coordinates
they imply, asked of one object whatever the grammar (pure, property-tested over every adapter's grammar)."""

import math
import pickle

import pytest
from hypothesis import assume, given, settings, strategies as st

from paracheck.adapters.diffusers.layout import DiffusersLayout
from paracheck.adapters.torch.layout import TorchLayout
from paracheck.adapters.transformers.layout import TfLayout
from paracheck.domain.layout import Grammar, Layout, LayoutError

#: A grammar of the host's own, naming no library: two kinds over three dimensions, one left out of the mesh.
TOY = Grammar(library="toy", dims=("a", "b", "c"), tokens=("a", "bb", "c"), kind=("x", "y", "y"), named=("c", "a", "b"),
              meshes=(("one", ("b", "a")), ("two", ("a", "b"))), factors=("x", "y", "a"), example="a2xbb2")

GRAMMARS = (DiffusersLayout, TfLayout, TorchLayout, TOY)


@st.composite
def layouts(draw):
    grammar = draw(st.sampled_from(GRAMMARS))
    order = draw(st.sampled_from([o for o, _ in grammar.meshes]))
    sizes = draw(st.lists(st.integers(1, 3), min_size=len(grammar.dims), max_size=len(grammar.dims)))
    layout = grammar(*sizes, order)
    assume(layout.world <= 12)  # every rank's coordinates and groups are walked: keep the worlds small
    return layout


@settings(max_examples=30)
@given(layouts())
def test_every_grammar_answers_the_same_questions(layout):
    mesh = dict(layout.grammar.meshes)[layout.order]
    assert isinstance(layout, Layout) and layout.world == math.prod(layout.degree(d) for d in mesh)
    if layout.name != "single":
        assert layout.grammar.parse(layout.name, layout.order) == layout
    seen = {tuple(layout.coords(r).items()) for r in range(layout.world)}
    assert len(seen) == layout.world and all(layout.rank_of(layout.coords(r)) == r for r in range(layout.world))
    for kind in set(layout.grammar.kind):
        in_mesh = tuple(d for d in layout.dims_of(kind) if d in mesh)
        groups = layout.groups(in_mesh)
        assert sorted(r for g in groups for r in g) == list(range(layout.world))
        assert {layout.index(g[0], kind) for g in groups} <= set(range(layout.size(kind)))
    assert pickle.loads(pickle.dumps(layout)) == layout and hash(pickle.loads(pickle.dumps(layout))) == hash(layout)


def test_degrees_by_name_and_by_kind():
    layout = TOY(a=2, b=3, c=5)
    assert layout.degrees == {"a": 2, "b": 3, "c": 5} and (layout.a, layout.b, layout.c) == (2, 3, 5)
    assert layout.x == 2 and layout.y == 15 and layout.size("y") == 15 and layout.dims_of("y") == ("b", "c")
    assert layout.world == 6  # c is in no mesh: not part of the world
    assert layout.name == "c5xa2xbb3" == TOY.parse("bb3xa2xc5").name and layout.kinds == ("a", "b", "c")
    assert layout.factor_degrees() == {"x": 2, "y": 15, "a": 2, "world": 6}
    assert layout.mesh_dims == ("b", "a") and layout.with_order("two").mesh_dims == ("a", "b")
    assert layout.coords(1) == {"a": 1, "b": 0} and layout.with_order("two").coords(1) == {"a": 0, "b": 1}
    with pytest.raises(AttributeError, match="toy layout has no dimension or kind 'z'"):
        layout.z


@pytest.mark.parametrize("make, fragment", [
    (lambda: TOY(0, 1, 1), "degree a=0: every degree must be an integer >= 1"),
    (lambda: TOY(True, 1, 1), "degree a=True"),
    (lambda: TOY(order="three"), "--order 'three': must be one of one, two"),
    (lambda: TOY.parse("a2xb2"), "part 'b2' is not one of cN, aN, bbN"),
    (lambda: TOY.parse("a2xa2"), "a appears twice"),
    (lambda: TOY(2, 1, 1).coords(2), "rank 2 is outside layout a2 of world size 2"),
])
def test_validation_names_the_rule(make, fragment):
    with pytest.raises(LayoutError, match=fragment):
        make()


def test_a_grammar_of_one_mesh_order_keeps_it_and_drops_unit_dims_where_it_says():
    assert TfLayout.parse("tp2", "tp-fastest").order == "cp-fastest"
    assert TorchLayout(tp=2, fsdp=2).mesh_dims == ("fsdp", "tp") and TfLayout(tp=2).coords(1)["pp"] == 0
    assert DiffusersLayout(tp=2).mesh_dims == ("tp", "ring", "ulysses")
    assert TfLayout(tp=2) != TorchLayout(tp=2)  # a layout is its grammar's


def test_a_group_along_a_dimension_off_the_mesh_is_refused_not_a_lone_rank():
    """transformers' `ep` lives on the expert mesh: a group along it on the dense mesh was [rank, rank]."""
    from paracheck.adapters.transformers.layout import TfLayout

    layout = TfLayout.parse("tp2xep2")
    with pytest.raises(ValueError, match="ep is not a dimension of its mesh"):
        layout.group(0, ("ep",))
    assert layout.group(0, ("tp",)) == [0, 1]
