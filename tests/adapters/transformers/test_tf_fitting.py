"""The transformers fitting rule over every causal-LM config class transformers registers, in process: configs
are built, never models."""


import pytest
from packaging.version import Version
from hypothesis import HealthCheck, given, settings, strategies as st

transformers = pytest.importorskip("transformers")

from paracheck.adapters.transformers import fitting  # noqa: E402
from paracheck.adapters.transformers.fitting import Need, Unfittable  # noqa: E402
from tests.adapters.transformers.tiny_configs import quiet_configs, tiny_of  # noqa: E402,F401 (quiet_configs: autouse)
from paracheck.adapters.transformers.layout import TfLayout  # noqa: E402


def _classes():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted({CONFIG_MAPPING[name] for name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES}, key=lambda c: c.__name__)


CLASSES = _classes()


needs = st.builds(Need, tp=st.sampled_from([1, 2, 4]), pp=st.sampled_from([1, 2, 4]), ep=st.sampled_from([1, 2, 4]),
                  dp=st.sampled_from([1, 2, 4]), itemsize=st.sampled_from([2, 4]))


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
@settings(max_examples=8, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(need=needs, heads=st.integers(1, 6), width=st.integers(1, 40), data=st.data())
def test_fit_returns_a_fitting_config_or_names_why(cls, need, heads, width, data):
    tiny = tiny_of(cls)
    if isinstance(tiny, Unfittable):
        assert str(tiny)
        return
    found = fitting.sizes(tiny)
    bent = {k: heads for k in found.get(fitting.HEADS, [])[:1]} | {k: width for k in found.get(fitting.WIDTH, [])[:1]
                                                                  if isinstance(getattr(tiny, k), int)}
    try:
        start = fitting._build(tiny, {**fitting._fields(tiny), **bent})
    except Unfittable:
        start = tiny
    try:
        fit = fitting.fit(start, need)
    except Unfittable as exc:
        # A refusal names the missing plan, or the sizes and rules, or transformers' own rejection.
        assert exc.missing_plan or exc.misfits or "rejects the fitted sizes" in str(exc), str(exc)
        if exc.missing_plan:
            assert fitting.refusal(start, need) == f"{cls.__name__} has no {exc.missing_plan}"
        return
    assert fitting.misfits(fit.config, need) == []
    assert fitting.refusal(fit.config, need) is None
    assert fitting.fit(fit.config, need).changes == []  # a fitted config is a fixed point


@pytest.mark.parametrize("cls", [c for c in CLASSES if getattr(c, "base_model_tp_plan", None)],
                         ids=lambda c: c.__name__)
def test_every_tiny_config_with_a_tp_plan_fits_four_ranks_or_names_why(cls):
    tiny = tiny_of(cls)
    if isinstance(tiny, Unfittable):
        assert "rejects the fitted sizes" in str(tiny) or "keeps its sizes in nested configs" in str(tiny)
        return
    need = Need(tp=4, pp=4 if cls.base_model_pp_plan else 1, ep=4 if getattr(cls, "base_model_ep_plan", None) else 1)
    try:
        fit = fitting.fit(tiny, need)
    except Unfittable as exc:
        assert "rejects the fitted sizes" in str(exc)
        return
    assert fitting.misfits(fit.config, need) == []


def test_the_unadjusted_llama_tester_config_is_refused_on_tp4_and_pp4_by_name():
    config = transformers.LlamaConfig(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2)
    tp4 = fitting.refusal(config, Need.of(TfLayout(tp=4)))
    assert "num_attention_heads=2 does not fit tp=4: tp must divide each head count" in tp4
    assert "vocab_size=99 does not fit tp=4" in tp4 and "intermediate_size=37 does not fit tp=4" in tp4
    pp4 = fitting.refusal(config, Need.of(TfLayout(pp=4)))
    assert pp4 == "num_hidden_layers=2 does not fit pp=4: every pipeline stage needs at least one layer (layers >= pp)"
    assert fitting.refusal(config, Need.of(TfLayout(fsdp=4))) is None
    assert fitting.refusal(config, Need.of(TfLayout(pp=2))) is None


def test_expert_widths_are_aligned_for_the_grouped_matmul_by_dtype():
    config = transformers.MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, num_local_experts=4)
    # 24 / 4 = 6 elements: 24 bytes in fp32, not a multiple of 16.
    problems = fitting.misfits(config, Need.of(TfLayout(tp=4)))
    assert [(m.key, m.degree, m.size) for m in problems] == [("intermediate_size", "tp", 4)]
    assert "multiple of 16 bytes, 4 elements of 4 bytes" in problems[0].rule
    assert fitting.misfits(config, Need.of(TfLayout(tp=2))) == []  # 12 elements of 4 bytes
    assert fitting.misfits(config, Need.of(TfLayout(tp=2), "bf16"))[0].value == 24  # 12 x 2 bytes = 24
    assert fitting.fit(config, Need.of(TfLayout(tp=4))).config.intermediate_size == 32


def test_raising_layers_lengthens_layer_types_and_keeps_every_kind():
    config = fitting.tiny(transformers.Gemma3TextConfig)
    assert config.num_hidden_layers == 2 and set(config.layer_types) == {"sliding_attention", "full_attention"}
    fit = fitting.fit(config, Need(pp=4))
    assert fit.config.num_hidden_layers == 4 and len(fit.config.layer_types) == 4
    assert "num_hidden_layers 2->4" in fit.changes


def test_a_batch_the_data_parallel_degree_does_not_divide_is_named():
    assert fitting.batch_misfit(3, Need(dp=2)).sentence() == (
        "batch=3 does not fit dpr x fsdp=2: the data-parallel degree must divide the batch")
    assert fitting.batch_misfit(4, Need(dp=2)) is None


@pytest.mark.parametrize("name", ["ministral", "hunyuan_v1_dense", "dots1", "gemma3n_text", "mimo_v2_flash",
                                  "nemotron_h", "longcat_flash", "phi4_multimodal"])
def test_a_tiny_config_fills_the_sizes_its_defaults_leave_unset_keeps_derived_ones_and_runs(name):
    """Their defaults leave `head_dim`, the expert counts or top-k None (which the model reads with no fallback),
    share keys and values across more layers than the tiny model keeps, double key/value heads on some layers,
    sum a head width from two parts, or divide Mamba heads by groups; the tiny config builds and trains."""
    import torch
    from transformers import AutoModelForCausalLM

    from paracheck.adapters.transformers import sweep

    if name == "hunyuan_v1_dense" and Version(transformers.__version__) < Version("5.24.0"):
        pytest.skip(f"transformers {transformers.__version__} gives hunyuan_v1_dense no TP plan (5.24.0 does)")
    [family] = sweep.families([name])
    config = sweep.fitted(family, 4).config
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ids = torch.randint(0, config.vocab_size, (2, 12))
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    assert torch.isfinite(out.loss)


def test_nested_sub_configs_are_shrunk_by_the_same_rule():
    """Phi4Multimodal keeps its text sizes at the top and builds a vision and an audio encoder from nested configs
    even for text inputs (870M parameters at their defaults): the tiny rule shrinks them as it shrinks the top,
    an encoder's block count and the channels its defaults make as wide as its hidden state with them."""
    import torch
    from transformers import AutoModelForCausalLM

    config = fitting.tiny(transformers.Phi4MultimodalConfig)
    for sub in (config.vision_config, config.audio_config):
        for role, keys in fitting.sizes(sub).items():
            assert all(getattr(sub, key) <= 64 for key in keys), (type(sub).__name__, role, keys)
    audio = config.audio_config
    assert audio.num_blocks == 2
    assert audio.nemo_conv_channels == audio.ext_pw_out_channel == audio.depthwise_separable_out_channel == 32
    with torch.device("meta"):
        count = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert count < 1_000_000


def test_other_experts_in_the_pool_shrink_with_the_routed_ones():
    """LongcatFlash pools 256 identity (zero-compute) experts with its 512 routed ones; left at 256 beside 4 routed
    ones, nearly every token routes to an identity expert and on some data-parallel rank no token reaches a routed
    one, whose weights then get no gradient there (FSDP2 reduces only the gradients a rank has: the ranks' reduces
    mismatch and gloo aborts)."""
    config = fitting.tiny(transformers.LongcatFlashConfig)
    assert config.zero_expert_num == config.n_routed_experts == 4


def test_a_family_whose_own_defaults_do_not_build_is_a_named_skip(tmp_path):
    from paracheck.adapters.transformers import sweep
    from paracheck.domain.records import RankStatus

    [family] = sweep.families(["lfm2_moe"])
    status, why = sweep.build(sweep.fitted(family, 4), str(tmp_path))
    assert status == RankStatus.SKIP and "Lfm2MoeConfig's own defaults do not build its model (TypeError" in why


def test_a_family_with_an_expert_plan_gets_its_moe_block_on_and_an_inert_plan_checks_nothing():
    """Gemma4's defaults leave its MoE block off; its tiny config turns it on. Where a model has no experts to
    dispatch to, transformers applies none of its EP plan, and the structure check expects none."""
    import torch
    from transformers import AutoModelForCausalLM

    from paracheck.adapters.transformers import sweep
    from paracheck.adapters.transformers.layout import TfLayout
    from paracheck.adapters.transformers.structure import active_plans

    [family] = sweep.families(["gemma4_text"])
    config = sweep.fitted(family, 4).config
    assert config.enable_moe_block and config.num_experts == 4
    with torch.device("meta"):
        moe = AutoModelForCausalLM.from_config(config)
        config.enable_moe_block = False
        dense = AutoModelForCausalLM.from_config(config)
    layout = TfLayout.parse("fsdp4xep2")
    assert active_plans(moe, layout)[1] and not active_plans(dense, layout)[1]
