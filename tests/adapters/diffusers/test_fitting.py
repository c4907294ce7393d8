"""Fitting models to layouts; and every installed diffusers model with a parallel plan has a fixture."""

import importlib
import inspect
import pkgutil

import pytest
import torch
from hypothesis import given, settings, strategies as st

import paracheck.fixtures as fixtures
from paracheck.domain.case import call_factory
from paracheck.adapters.diffusers.fitting import (
    OTHER_HEADS,
    Unfittable,
    cp_split_problems,
    fit_block_counts,
    fit_init_dict,
    plan_block_needs,
    split_problems,
)
from paracheck.adapters.diffusers.layout import DiffusersLayout, head_multiple, layouts_for


def _fixture_classes():
    return {call_factory(path)[0].__name__ for path in fixtures.FIXTURES.values()}


def _models_with_a_plan():
    """Every diffusers model class with a `_tp_plan` or a `_cp_plan`: those `diffusers.models` exports, and
    those defined in any module of `diffusers.models.transformers` (exported or not)."""
    import diffusers
    import diffusers.models as models
    import diffusers.models.transformers as transformers

    candidates = []
    for name in dir(models):
        try:
            candidates.append(getattr(models, name))
        except Exception:  # an export whose optional dependency is missing
            continue
    for info in pkgutil.iter_modules(transformers.__path__):
        try:
            module = importlib.import_module(f"{transformers.__name__}.{info.name}")
        except Exception:
            continue
        candidates.extend(vars(module).values())
    return {
        cls.__name__ for cls in candidates
        if inspect.isclass(cls) and issubclass(cls, diffusers.ModelMixin)
        and (getattr(cls, "_tp_plan", None) or getattr(cls, "_cp_plan", None))
    }


def test_every_model_with_a_plan_has_a_fixture():
    import diffusers
    from packaging.version import Version

    planned = _models_with_a_plan()
    # 0.42 has ten (0.41.0 nine: its QwenImage21 carries no plan); fewer means the search above went blind
    assert len(planned) >= (9 if Version(diffusers.__version__) < Version("0.42.0") else 10)
    missing = sorted(planned - _fixture_classes())
    assert not missing, f"diffusers models with a _tp_plan or _cp_plan but no fixture in fixtures/: {missing}"


def test_fixtures_include_cp_only_models():
    cp_only = [c for c in map(lambda p: call_factory(p)[0], fixtures.FIXTURES.values()) if not c._tp_plan]
    assert len(cp_only) >= 2


@given(st.integers(1, 12), st.sampled_from(["tp2", "u4", "tp2xu2", "tp4", "tp2xu4"]))
def test_ltx_fit_keeps_cross_attention_tied(heads, name):
    from diffusers import LTXVideoTransformer3DModel

    layout = DiffusersLayout.parse(name)
    if layout.has_tp:
        with pytest.raises(Unfittable, match="no _tp_plan"):
            fit_init_dict(LTXVideoTransformer3DModel, {"num_attention_heads": heads}, layout)
        return
    fit = fit_init_dict(LTXVideoTransformer3DModel, {"num_attention_heads": heads, "attention_head_dim": 12}, layout)
    new = fit.init_dict["num_attention_heads"]
    assert new % head_multiple(layout) == 0
    if new != heads:
        assert fit.init_dict["cross_attention_dim"] == new * 12


def test_ltx_fit_is_proved_by_a_forward():
    cls, init, inputs = fixtures.ltx()
    fit = fit_init_dict(cls, init, DiffusersLayout.parse("u4"))
    assert fit.changes == ["num_attention_heads 2->4", "cross_attention_dim 24->48"]
    torch.manual_seed(0)
    cls(**fit.init_dict)(**inputs, return_dict=False)


def test_raising_ltx_heads_alone_fails():
    """Why the tie exists: heads without cross_attention_dim is a shape error."""
    cls, init, inputs = fixtures.ltx()
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
        cls(**dict(init, num_attention_heads=4))(**inputs, return_dict=False)


@settings(deadline=None, max_examples=25)
@given(st.integers(1, 40))
def test_cp_split_problems_name_input_and_dimension(tokens):
    cls, init, inputs = fixtures.flux()
    inputs["hidden_states"] = torch.zeros(1, tokens, 4)
    problems = cp_split_problems(cls, inputs, DiffusersLayout.parse("u4"))
    assert bool(problems) == (tokens % 4 != 0)
    if problems:
        assert "'hidden_states' dim 1" in problems[0] and f"size {tokens}" in problems[0]


@settings(deadline=None, max_examples=40)
@given(st.lists(st.tuples(st.sampled_from(["input 'x'", "rope's output 0", "blocks.0's input 'h'"]),
                          st.integers(0, 3), st.integers(1, 70)), max_size=6),
       st.sampled_from([DiffusersLayout.parse(n) for n in ("u2", "r2xu2", "tp2xu4", "r4xu8", "r8xu4", "tp4")]))
def test_split_problems_refuse_exactly_what_the_degree_does_not_divide(splits, layout):
    """The pure rule over every split, inner entries alike: refused iff the CP degree does not divide its size; one
    sentence per refused size naming each split of that size, the size, the degree and its factors."""
    problems = split_problems(splits, layout)
    refused = {size for _, _, size in splits if layout.has_cp and size % layout.cp}
    assert len(problems) == len(refused)
    for size, sentence in zip(dict.fromkeys(s for _, _, s in splits if s in refused), problems):
        assert f"size {size}, which the CP degree {layout.cp} (ring {layout.ring} x ulysses {layout.ulysses}) " \
               "does not divide" in sentence and f"into {layout.cp} equal shards" in sentence
        assert all(f"{what} dim {dim}" in sentence for what, dim, s in splits if s == size)


def test_inner_plan_entries_are_read_from_a_meta_forward():
    """MiniMax-H3 splits nothing at the top level: its packed sequence (16 rows) is split at five places inside
    the model, which one forward on meta names with their dims; Flux's plan is top-level only (no forward)."""
    from paracheck.adapters.diffusers.splits import inner_entries, plan_splits

    cls, init, inputs = fixtures.minimax_h3()
    assert set(plan_splits(cls, init, inputs)) == {
        ("rope's output 0", 0, 16), ("rope's output 1", 0, 16), ("transformer_blocks.0's input 'hidden_states'", 1, 16),
        ("transformer_blocks.*'s input 'adaln_indices'", 0, 16), ("norm_out's input 'timestep_indices'", 0, 16)}
    cls, init, inputs = fixtures.flux()
    assert not inner_entries(cls._cp_plan)
    assert {s.what for s in plan_splits(cls, init, inputs)} == {
        "input 'hidden_states'", "input 'encoder_hidden_states'", "input 'img_ids'", "input 'txt_ids'"}


def test_minimax_h3_at_32_ranks_is_a_skip_decided_by_the_plan():
    """Found running `--local-world 32`: r4xu8 and r8xu4 were an error on every rank (the library's split
    asserts); the plan refuses them before any parallel code, in one sentence. At 16 the degree divides 16."""
    from paracheck.adapters.diffusers.plan import Sources, plan
    from paracheck.domain.backends import get_backend
    from paracheck.domain.case import Case
    from paracheck.domain.records import RankStatus

    sources = Sources()
    for name in ("r4xu8", "r8xu4", "r2xu8"):
        layout = DiffusersLayout.parse(name)
        p = plan(Case("minimax_h3", fixtures.FIXTURES["minimax_h3"], layout, library="diffusers"),
                 get_backend("gloo"), sources)
        if layout.cp == 16:
            assert p.stop is None
            continue
        assert p.stop.status == RankStatus.SKIP
        assert p.stop.reason == (
            "rope's output 0 dim 0, rope's output 1 dim 0, transformer_blocks.0's input 'hidden_states' dim 1, "
            "transformer_blocks.*'s input 'adaln_indices' dim 0, norm_out's input 'timestep_indices' dim 0 have "
            f"size 16, which the CP degree 32 (ring {layout.ring} x ulysses {layout.ulysses}) does not divide (the "
            "_cp_plan splits each into 32 equal shards, one per CP rank)")


def test_no_plan_no_fit():
    cls, init, _ = fixtures.wan()
    with pytest.raises(Unfittable, match="WanTransformer3DModel has no _tp_plan"):
        fit_init_dict(cls, init, DiffusersLayout.parse("tp2xu2"))


# -- the other head groups and their ties (LTX2's audio stream) ---------------------------------------


def test_ltx2_fit_raises_audio_heads_with_their_ties():
    cls, init, inputs = fixtures.ltx2()
    fit = fit_init_dict(cls, init, DiffusersLayout.parse("u4"))
    assert fit.changes == ["num_attention_heads 2->4", "cross_attention_dim 16->32",
                           "audio_num_attention_heads 2->4", "audio_cross_attention_dim 8->16"]
    torch.manual_seed(0)
    cls(**fit.init_dict)(**inputs, return_dict=False)


@pytest.mark.parametrize("heads_key", ["num_attention_heads", "audio_num_attention_heads"])
def test_raising_ltx2_heads_alone_fails(heads_key):
    """Why each tie exists: a head count raised without its cross-attention dim is a shape error."""
    cls, init, inputs = fixtures.ltx2()
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
        cls(**dict(init, **{heads_key: 4}))(**inputs, return_dict=False)


def _fixture_fits():
    """(fixture, layout) for every fixture and every 4-rank layout it takes, one per distinct fitted config."""
    cases, seen = [], set()
    for name, path in fixtures.FIXTURES.items():
        cls, init, _ = call_factory(path)
        for layout in layouts_for(4):
            try:
                fitted = fit_init_dict(cls, init, layout).init_dict
            except Unfittable:
                continue
            key = (name, repr(sorted(fitted.items())))
            if key not in seen:
                seen.add(key)
                cases.append(pytest.param(name, layout.name, id=f"{name}-{layout.name}"))
    return cases


@pytest.mark.parametrize("name,layout", _fixture_fits())
def test_every_fitted_fixture_runs_on_one_device(name, layout):
    """Proves TIED_TO_INNER_DIM and OTHER_HEADS complete: the models missing from them take raised heads
    with nothing else changed."""
    cls, init, inputs = getattr(fixtures, name)()
    fit = fit_init_dict(cls, init, DiffusersLayout.parse(layout))
    torch.manual_seed(0)
    out = cls(**fit.init_dict)(**inputs, return_dict=False)[0]
    assert torch.isfinite(out).all()


def test_other_heads_name_real_init_keys():
    import diffusers

    for class_name, groups in OTHER_HEADS.items():
        parameters = inspect.signature(getattr(diffusers, class_name).__init__).parameters
        for heads_key, head_dim_key, tied in groups:
            assert {heads_key, head_dim_key, *tied} <= set(parameters), class_name


# -- block counts: plans that name fixed block indices (Helios) --------------------------------------


class _Stack:
    """A stand-in with a Helios-style plan: `blocks.*` plus `blocks.0` ... `blocks.5` named one by one."""

    _cp_plan = {"blocks.*.attn": {"hidden_states": "split"},
                **{f"blocks.{i}.attn": "gather" for i in range(6)},
                "blocks.2.ff.net.4": "gather"}

    def __init__(self, num_layers: int = 1, num_attention_heads: int = 2):
        pass


class _UnknownStack:
    _cp_plan = {"layers.3.attn": "gather"}

    def __init__(self, depth: int = 2):
        pass


def test_plan_block_needs_reads_indices_per_list():
    plan = {"": {}, "rope": {0: "split", 1: "split"}, "blocks.*.attn1": {}, "blocks.39.attn1": "gather",
            "blocks.7.ffn": "gather", "stages.1.blocks.3.attn": "gather", "transformer_blocks.*.attn.to_out.0": "rowwise"}
    assert plan_block_needs(plan) == {
        "blocks": (40, "blocks.39.attn1"),
        "stages": (2, "stages.1.blocks.3.attn"),
        "stages.*.blocks": (4, "stages.1.blocks.3.attn"),
        "transformer_blocks.*.attn.to_out": (1, "transformer_blocks.*.attn.to_out.0"),
    }
    assert plan_block_needs({"blocks.*.attn": {}, "proj_out": "gather"}) == {}


@settings(deadline=None, max_examples=30)
@given(st.integers(1, 12), st.sampled_from(["u2", "u4", "r4", "r2xu2"]))
def test_fixed_block_indices_raise_the_layer_count(layers, name):
    fit = fit_init_dict(_Stack, {"num_layers": layers, "num_attention_heads": 4}, DiffusersLayout.parse(name))
    assert fit.init_dict["num_layers"] == max(layers, 6)
    if layers < 6:
        assert fit.changes == [f"num_layers {layers}->6 (_cp_plan names blocks.5.attn)"]
    else:
        assert fit.changes == []


def test_block_counts_only_for_the_plans_in_use():
    assert fit_block_counts(_Stack, {"num_layers": 2}, [])[0] == {"num_layers": 2}
    assert fit_init_dict(_Stack, {}, DiffusersLayout.parse("u2")).init_dict == {"num_layers": 6}  # from the default 1


def test_unknown_block_count_key_is_unfittable_naming_the_plan_key():
    with pytest.raises(Unfittable, match=r"_cp_plan names 'layers.3.attn'.*BLOCK_COUNT_KEYS"):
        fit_init_dict(_UnknownStack, {}, DiffusersLayout.parse("r2"))  # ring: no head fitting in the way


def test_non_integer_block_count_is_unfittable():
    from diffusers import HeliosTransformer3DModel

    with pytest.raises(Unfittable, match=r"names 'blocks.39.attn1', but num_layers is None"):
        fit_init_dict(HeliosTransformer3DModel, {"num_layers": None}, DiffusersLayout.parse("u4"))


def test_helios_fit_names_blocks_39():
    cls, init, _ = fixtures.helios()
    assert init["num_layers"] < 40
    fit = fit_init_dict(cls, init, DiffusersLayout.parse("u2"))
    assert fit.changes == ["num_layers 2->40 (_cp_plan names blocks.39.attn1)"]
    assert fit_init_dict(cls, init, DiffusersLayout.parse("u4")).changes == [
        "num_attention_heads 2->4", "num_layers 2->40 (_cp_plan names blocks.39.attn1)"]


def test_fitted_helios_runs_on_one_device():
    cls, init, inputs = fixtures.helios()
    fit = fit_init_dict(cls, init, DiffusersLayout.parse("u4"))
    torch.manual_seed(0)
    model = cls(**fit.init_dict)
    assert len(model.blocks) == 40
    out = model(**inputs, return_dict=False)[0]
    assert out.shape == inputs["hidden_states"].shape and torch.isfinite(out).all()


def test_fork_server_preloads_every_fixture_class():
    from paracheck.adapters.diffusers.fixtures_index import FIXTURE_CLASSES

    assert _fixture_classes() == set(FIXTURE_CLASSES)
