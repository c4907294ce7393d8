"""Which controls apply where: pure rules, no process group."""

import pytest
from hypothesis import given

from paracheck.domain.registry import get_control
from paracheck.adapters.diffusers.controls import CONTROLS, applicable
from tests import strategies
from paracheck.adapters.diffusers.layout import DiffusersLayout, layouts_for

layouts = strategies.layouts(6, 4)


@given(layouts)
def test_global_rank_index_applies_exactly_where_it_can_show(layout):
    differs = any(r % layout.tp != layout.coords(r)["tp"] for r in range(layout.world))
    assert ("global-rank-shard-index" in applicable(layout)) == (layout.has_tp and differs)


@given(layouts)
def test_the_collapsed_cp_index_is_the_tp_coordinate_on_every_mesh_with_at_most_two_dimensions_above_1(layout):
    """Why `cp-collapsed-shard-index` passes every check on any 4-rank layout: with ring or Ulysses at 1 the one
    CP dimension it reads the rank over is the CP group itself, so it re-slices each rank's own shard (a no-op);
    it applies exactly where some rank's index differs, which takes tp, ring and ulysses all above 1."""
    from paracheck.adapters.diffusers.controls import collapsed_cp_tp_index

    differs = any(collapsed_cp_tp_index(layout, r) != layout.coords(r)["tp"] for r in range(layout.world))
    if min(layout.tp, layout.ring, layout.ulysses) == 1:
        assert not differs
    assert ("cp-collapsed-shard-index" in applicable(layout)) == (layout.has_tp and differs)


def test_the_collapsed_cp_index_is_wrong_on_half_the_ranks_of_tp2xr2xu2():
    from paracheck.adapters.diffusers.controls import collapsed_cp_tp_index

    layout = DiffusersLayout.parse("tp2xr2xu2")
    assert [collapsed_cp_tp_index(layout, r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]  # TP coords 0 0 0 0 1 1 1 1
    assert "cp-collapsed-shard-index" not in applicable(DiffusersLayout.parse("tp2xr2xu2", "tp-fastest"))
    assert not {"cp-collapsed-shard-index"} & {n for w in (4, 8) for l in layouts_for(w) if l.name != "tp2xr2xu2"
                                               for n in applicable(l)}


@given(layouts)
def test_cp_controls_need_cp_and_backward_only_always_applies(layout):
    names = applicable(layout)
    assert "backward-only" in names
    for name in ("skip-cp-hooks", "skip-processor-config", "skip-output-gather", "cp-attention-local"):
        assert (name in names) == layout.has_cp
    assert ("tp-processor-config" in names) == (layout.has_tp and not layout.has_cp)


def test_mesh_order_control_is_planted_by_the_composed_route_only():
    control, layout = get_control("swapped-mesh-order"), DiffusersLayout.parse("tp2xu2")
    assert control.skip_reason(layout, "composed") is None
    assert "planted by the composed route, not native" in control.skip_reason(layout, "native")
    assert control.skip_reason(DiffusersLayout.parse("tp4"), "composed") is not None


def test_every_control_names_checks_it_must_trip():
    from paracheck.domain.records import CheckId

    assert all(c.must_trip and set(c.must_trip) <= set(CheckId) for c in CONTROLS.values())


def test_a_control_is_detected_only_when_every_must_trip_check_failed():
    from paracheck.domain.records import CaseStatus, CheckId

    control = get_control("skip-output-gather")
    assert control.judge({CheckId.CP_HOOKS, CheckId.FORWARD})[0] == CaseStatus.DETECTED
    status, reason = control.judge({CheckId.CP_HOOKS})
    assert status == CaseStatus.MISSED and "still passing: parity.forward" in reason


def test_no_module_outside_controls_names_a_control():
    import pathlib

    import paracheck
    from paracheck.adapters.diffusers.pipelines.controls import PIPELINE_CONTROLS

    package = pathlib.Path(paracheck.__file__).parent
    for path in package.rglob("*.py"):
        if path.name == "controls.py":
            continue
        text = path.read_text()
        named = [name for name in {**CONTROLS, **PIPELINE_CONTROLS} if f'"{name}"' in text]
        assert not named, f"{path.name} names {named}"


def test_every_attention_fault_belongs_to_one_control_and_is_planted_by_the_attention_module():
    """A control that plants a fault names one `attention.FAULTS` string; each fault is one control's, and
    the strings live in controls.py and attention.py (which plants them) only."""
    import pathlib

    import paracheck
    from paracheck.adapters.diffusers.attention import FAULTS

    faults = [c.attention_fault for c in CONTROLS.values() if c.attention_fault]
    assert sorted(faults) == sorted(FAULTS), "each fault is planted by exactly one control"
    assert {c.name: c.attention_fault for c in CONTROLS.values() if c.attention_fault} == {
        "ring-stale-kv-backward": "stale-kv-backward", "ring-drop-merge": "drop-ring-merge",
        "cp-attention-local": "ignore-cp-config", "inference-attention-local": "ignore-cp-config-no-grad"}
    package = pathlib.Path(paracheck.__file__).parent
    for path in package.rglob("*.py"):
        if path.name in ("controls.py", "attention.py"):
            continue
        named = [fault for fault in FAULTS if f'"{fault}"' in path.read_text()]
        assert not named, f"{path.name} names the attention faults {named}"


@pytest.mark.parametrize("family,router", [
    ("qwen3_moe", "Qwen3MoeTopKRouter"), ("longcat_flash", "LongcatFlashTopkRouter"),
    ("afmoe", "AfmoeTokenChoiceRouter"), ("gemma4_text", "Gemma4TextRouter"), ("hunyuan_v1_moe", "HunYuanMoEV1Gate"),
    ("kimi_linear", "KimiLinearTopkRouter")])
def test_the_router_control_plants_in_every_router_whatever_holds_its_weight(family, router):
    """A router's scoring weight may be its own or a child projection's (longcat_flash's `classifier`, afmoe's
    `gate`, gemma4's `proj`, whose top-k is read from the config), and HunYuan's is a gate; a linear-attention
    forget gate (kimi_linear's) picks no expert. Models on the meta device, from the sweep's tiny configs."""
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM

    from paracheck.adapters.transformers import sweep
    from paracheck.adapters.transformers.controls import _routers

    [found] = sweep.families([family])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(sweep.fitted(found, 4).config)
    names = {type(m).__name__ for m in _routers(model)}
    assert names == {router}
