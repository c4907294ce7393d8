"""Fitting models to layouts; and every diffusers model with both plans has a fixture."""

import inspect

import pytest
import torch
from hypothesis import given, settings, strategies as st

import paracheck.fixtures as fixtures
from paracheck.case import call_factory
from paracheck.fitting import Unfittable, cp_split_problems, fit_init_dict
from paracheck.layout import Layout


def _fixture_classes():
    return {call_factory(path)[0].__name__ for path in fixtures.FIXTURES.values()}


def test_every_model_with_both_plans_has_a_fixture():
    import diffusers
    import diffusers.models as models

    covered = _fixture_classes()
    missing = []
    for name in dir(models):
        try:
            cls = getattr(models, name)
        except Exception:
            continue
        if inspect.isclass(cls) and issubclass(cls, diffusers.ModelMixin):
            if getattr(cls, "_tp_plan", None) and getattr(cls, "_cp_plan", None) and name not in covered:
                missing.append(name)
    assert not missing, f"models with _tp_plan and _cp_plan but no fixture in fixtures/: {missing}"


def test_fixtures_include_cp_only_models():
    cp_only = [c for c in map(lambda p: call_factory(p)[0], fixtures.FIXTURES.values()) if not c._tp_plan]
    assert len(cp_only) >= 2


@given(st.integers(1, 12), st.sampled_from(["tp2", "u4", "tp2xu2", "tp4", "tp2xu4"]))
def test_ltx_fit_keeps_cross_attention_tied(heads, name):
    from diffusers import LTXVideoTransformer3DModel

    layout = Layout.parse(name)
    if layout.has_tp:
        with pytest.raises(Unfittable, match="no _tp_plan"):
            fit_init_dict(LTXVideoTransformer3DModel, {"num_attention_heads": heads}, layout)
        return
    fit = fit_init_dict(LTXVideoTransformer3DModel, {"num_attention_heads": heads, "attention_head_dim": 12}, layout)
    new = fit.init_dict["num_attention_heads"]
    assert new % layout.head_multiple == 0
    if new != heads:
        assert fit.init_dict["cross_attention_dim"] == new * 12


def test_ltx_fit_is_proved_by_a_forward():
    cls, init, inputs = fixtures.ltx()
    fit = fit_init_dict(cls, init, Layout.parse("u4"))
    assert fit.changes == ["num_attention_heads 2->4", "cross_attention_dim 24->48"]
    torch.manual_seed(0)
    cls(**fit.init_dict)(**inputs, return_dict=False)


def test_raising_ltx_heads_alone_fails():
    """Why the tie exists: heads without cross_attention_dim is a shape error."""
    cls, init, inputs = fixtures.ltx()
    with pytest.raises(RuntimeError):
        cls(**dict(init, num_attention_heads=4))(**inputs, return_dict=False)


@settings(deadline=None, max_examples=25)
@given(st.integers(1, 40))
def test_cp_split_problems_name_input_and_dimension(tokens):
    cls, init, inputs = fixtures.flux()
    inputs["hidden_states"] = torch.zeros(1, tokens, 4)
    problems = cp_split_problems(cls, inputs, Layout.parse("u4"))
    assert bool(problems) == (tokens % 4 != 0)
    if problems:
        assert "'hidden_states' dim 1" in problems[0] and f"size {tokens}" in problems[0]


def test_no_plan_no_fit():
    cls, init, _ = fixtures.wan()
    with pytest.raises(Unfittable, match="WanTransformer3DModel has no _tp_plan"):
        fit_init_dict(cls, init, Layout.parse("tp2xu2"))
