"""Which controls apply where: pure rules, no process group."""

from hypothesis import given, strategies as st

from paracheck.controls import CONTROLS, applicable, get_control
from paracheck.layout import Layout

layouts = st.builds(Layout, st.integers(1, 6), st.integers(1, 4), st.integers(1, 4),
                    st.sampled_from(["cp-fastest", "tp-fastest"])).filter(lambda l: l.world > 1)


@given(layouts)
def test_global_rank_index_applies_exactly_where_it_can_show(layout):
    differs = any(r % layout.tp != layout.coords(r)["tp"] for r in range(layout.world))
    assert ("global-rank-shard-index" in applicable(layout)) == (layout.has_tp and differs)


@given(layouts)
def test_cp_controls_need_cp_and_backward_only_always_applies(layout):
    names = applicable(layout)
    assert "backward-only" in names
    for name in ("skip-cp-hooks", "skip-processor-config", "skip-output-gather"):
        assert (name in names) == layout.has_cp
    assert ("tp-processor-config" in names) == (layout.has_tp and not layout.has_cp)


def test_mesh_order_control_is_planted_by_the_composed_route_only():
    control, layout = get_control("swapped-mesh-order"), Layout.parse("tp2xu2")
    assert control.skip_reason(layout, "composed") is None
    assert "planted by the composed route, not native" in control.skip_reason(layout, "native")
    assert control.skip_reason(Layout.parse("tp4"), "composed") is not None


def test_every_control_names_checks_it_must_trip():
    from paracheck.checks import CHECK_IDS

    assert all(c.must_trip and set(c.must_trip) <= set(CHECK_IDS) for c in CONTROLS.values())
