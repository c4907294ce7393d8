"""The transformers fitting rule on nested sub-configs (a vision-language model's `text_config`, its vision, audio
and projector configs), in process over every config class the causal-LM, image-text, multimodal, classification,
seq2seq and speech auto mappings register whose default config or `text_config` carries a TP plan: configs are
built, never models."""

import itertools
import re

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

transformers = pytest.importorskip("transformers")

from paracheck.adapters.transformers import fitting  # noqa: E402
from paracheck.adapters.transformers.fitting import Need, Unfittable  # noqa: E402
from tests.adapters.transformers.tiny_configs import quiet_configs, tiny_of  # noqa: E402,F401 (quiet_configs: autouse)

MAPPINGS = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
            "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
            "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
            "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES")


def _planned(cls) -> bool:
    """Whether the class's default config, or its `text_config`, carries a TP plan (read from the sub-config's
    class where the config names it, so no default is built to find out)."""
    if cls.base_model_tp_plan:
        return True
    text = (cls.sub_configs or {}).get("text_config")
    if text is not None and text.__name__ != "AutoConfig":
        return bool(text.base_model_tp_plan)
    if text is None:
        return False
    try:
        return bool(getattr(cls().text_config, "base_model_tp_plan", None))
    except Exception:  # a class whose defaults do not build: `tiny` names it
        return True


def _classes():
    from transformers.models.auto import modeling_auto
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    names = {n for m in MAPPINGS for n in getattr(modeling_auto, m, {}) if n in CONFIG_MAPPING}
    return sorted({CONFIG_MAPPING[n] for n in names} - {None}, key=lambda c: c.__name__)


CLASSES = [c for c in _classes() if _planned(c)]
#: Every (tp, pp, ep, dp) whose degrees multiply to 4.
LAYOUTS = [d for d in itertools.product((1, 2, 4), repeat=4) if d[0] * d[1] * d[2] * d[3] == 4]
#: The classes with a part that counts its layers by a per-layer list alone, always tried: NeMo SpeechLM's text
#: model kept its 52 layers through tiny and fit.
LISTED = [c for c in CLASSES if c.__name__ in ("Nemotron3_5TranscribeConfig", "NemotronHConfig",
                                               "NemotronH_Omni_Reasoning_V3_Config")]
#: Classes whose vision or audio tower counts its layers by another name (`depth`, `encoder_layers`) and indexes
#: some of them (`fullatt_block_indexes`, `deepstack_visual_indexes`), always tried: they kept 24 to 32 layers.
DEEP = [c for c in CLASSES if c.__name__ in ("Qwen2_5_VLConfig", "Qwen3VLConfig", "Glm4vConfig", "Qwen2AudioConfig")]


#: Every key the config classes of the seven mappings count a stack's layers by (measured over their tiny configs on
#: transformers 5.25.0: any int key naming layers, blocks or depth, less thresholds and group sizes).
_DEPTH = re.compile(r"^(?:num_hidden_layers|n_layer|num_layers|depth|n_layers|num_blocks|encoder_layers|decoder_layers"
                    r"|conf_num_hidden_layers)$")


def _depths(part) -> dict[str, int]:
    """Every layer count of a config part, by its key."""
    return {k: v for k, v in fitting._fields(part).items() if _DEPTH.match(k) and fitting._is_int(v)}


def _listed_layers(part) -> int | None:
    """The layer count of a config part that counts its layers by a per-layer list alone (no layer-count key, its
    `num_hidden_layers` the length of one of its lists), else None."""
    if fitting.sizes(part).get(fitting.LAYERS):
        return None
    count = getattr(part, "num_hidden_layers", None)
    lists = [v for v in fitting._fields(part).values() if isinstance(v, list)]
    return count if isinstance(count, int) and any(len(v) == count for v in lists) else None


def _always(*classes):
    def tried(test):
        for cls in classes:
            test = example(cls=cls, degrees=(4, 1, 1, 1), itemsize=4)(test)
        return test
    return tried


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cls=st.sampled_from(CLASSES), degrees=st.sampled_from(LAYOUTS), itemsize=st.sampled_from([2, 4]))
@_always(*LISTED, *DEEP)
def test_fit_reaches_every_nested_config_or_names_the_key_it_cannot_fit(cls, degrees, itemsize):
    tp, pp, ep, dp = degrees
    need = Need(tp=tp, pp=pp, ep=ep, dp=dp, itemsize=itemsize)
    tiny = tiny_of(cls)
    if isinstance(tiny, Unfittable):
        assert "rejects" in str(tiny), str(tiny)
        return
    try:
        fit = fitting.fit(tiny, need)
    except Unfittable as exc:
        # The plan it lacks, each size by its key path, or transformers' own rejection in its words.
        assert exc.missing_plan or exc.misfits or "rejects the fitted sizes" in str(exc), str(exc)
        named = [exc.missing_plan] if exc.missing_plan else [m.key for m in exc.misfits]
        assert all(key and key in str(exc) for key in named), str(exc)
        return
    for path, part, part_need in fitting.parts(fit.config, need):
        assert fitting.misfits(part, part_need) == [], (path, type(part).__name__)
        layers = _listed_layers(part)  # the tiny rule's depth (a layer per kind, at most 4), a layer per stage
        assert layers is None or part_need.pp <= layers <= max(4, part_need.pp), (path, type(part).__name__, layers)
        deep = {k: v for k, v in _depths(part).items() if v > max(4, part_need.pp)}
        assert not deep, (path, type(part).__name__, deep)  # no tower left at full depth, by any name
    assert fitting.refusal(fit.config, need) is None
    assert fitting.fit(fit.config, need).changes == []  # a fitted config is a fixed point


def _llava(text_heads=2, **text):
    return transformers.LlavaConfig(text_config={
        **dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
               num_attention_heads=text_heads, num_key_value_heads=text_heads), **text})


def test_a_per_layer_list_that_counts_the_layers_is_cut_and_lengthened_as_a_layer_count():
    """NemotronH counts its layers by `layers_block_type` alone: the tiny rule keeps a layer of each kind, a pipeline
    longer than the list is named by it, and fitting (its part rule: NemotronH has no PP plan in 5.25) lengthens it
    with every kind kept."""
    assert tiny_of(transformers.NemotronHConfig).num_hidden_layers == len(set(
        transformers.NemotronHConfig().layers_block_type))
    config = transformers.NemotronHConfig(**{**fitting._fields(tiny_of(transformers.NemotronHConfig)),
                                             "layers_block_type": ["linear_attention", "full_attention"]})
    assert [(m.key, m.value) for m in fitting.misfits(config, Need(pp=4))] == [("layers_block_type", 2)]
    fitted, changes = fitting._fit_part(config, Need(pp=4))
    assert fitted.layers_block_type == ["linear_attention", "full_attention"] * 2 and fitted.num_hidden_layers == 4
    assert fitting.misfits(fitted, Need(pp=4)) == [] and changes[0].startswith("layers_block_type ")


@pytest.mark.parametrize("config_class", ["ConvNextConfig", "SegformerConfig"])
def test_a_list_of_numbers_as_long_as_the_layer_count_is_no_layer_list(config_class):
    """ConvNext's `hidden_sizes` and SegFormer's `depths` (one number per stage) are as long as the layer count the
    config reports, but count no layers: only a list of layer kinds is read as the depth."""
    config = getattr(transformers, config_class)()
    assert fitting._layer_list(config, fitting.sizes(config)) is None


def test_a_text_config_size_a_layout_splits_is_named_by_its_key_path_and_fitted():
    config = _llava(vocab_size=130)
    assert fitting.plan_problems(config, Need(tp=4, pp=4)) is None  # the plans live on its text_config
    refusal = fitting.refusal(config, Need(tp=4))
    assert "text_config.num_attention_heads=2 does not fit tp=4: tp must divide each head count" in refusal
    assert "text_config.vocab_size=130 does not fit tp=4" in refusal
    fit = fitting.fit(config, Need(tp=4, pp=4))
    text = fit.config.text_config
    assert (text.num_attention_heads, text.vocab_size, text.num_hidden_layers) == (4, 132, 4)
    assert "text_config.num_attention_heads 2->4" in fit.changes and "text_config.num_hidden_layers 2->4" in fit.changes
    assert fitting.misfits(fit.config, Need(tp=4, pp=4)) == []


def test_a_vision_config_no_plan_reaches_is_left_whole_and_one_with_a_plan_is_fitted():
    """Llava's CLIP tower has no plan (replicated on every rank: its 3 heads are not split); Llama4's vision
    config has its own TP plan, so its heads are split and fitted as the text config's are."""
    llava = _llava(text_heads=4)
    llava.vision_config.num_attention_heads, llava.vision_config.hidden_size = 3, 48
    assert fitting.misfits(llava, Need(tp=4, pp=2)) == []
    assert fitting.fit(llava, Need(tp=4)).changes == []
    llama4 = fitting.tiny(transformers.Llama4Config)
    assert [p for p, _, n in fitting.parts(llama4, Need(tp=4)) if n.tp == 4] == ["", "vision_config", "text_config"]
    fit = fitting.fit(llama4, Need(tp=4))
    assert fit.config.vision_config.num_attention_heads % 4 == 0 and fit.config.text_config.num_attention_heads % 4 == 0
    assert any(c.startswith("vision_config.num_attention_heads ") for c in fit.changes)


def test_a_layout_the_text_config_has_no_plan_for_is_refused_by_the_plan():
    config = fitting.tiny(transformers.PaliGemmaConfig)  # gemma: TP and PP plans, no expert plan
    assert fitting.plan_problems(config, Need(tp=2, pp=2)) is None
    with pytest.raises(Unfittable) as caught:
        fitting.fit(config, Need(ep=4))
    assert caught.value.missing_plan == "base_model_ep_plan"
    assert fitting.refusal(config, Need(ep=4)) == "PaliGemmaConfig has no base_model_ep_plan"


def test_a_size_tied_to_the_text_hidden_size_follows_it():
    """GraniteDocling's config requires `vision_config.out_hidden_size == text_config.hidden_size`: the tiny rule
    shrinks it with the text width, and fitting raises it with it."""
    config = fitting.tiny(transformers.GraniteDoclingConfig)
    assert config.vision_config.out_hidden_size == config.text_config.hidden_size
    fit = fitting.fit(config, Need(tp=4))
    assert fit.config.vision_config.out_hidden_size == fit.config.text_config.hidden_size
    assert fit.config.text_config.hidden_size != config.text_config.hidden_size


def test_a_size_validated_as_a_quotient_of_the_text_width_follows_it():
    """FunAsrNano's config requires its adaptor's `intermediate_size` to be a quarter of the text width (it was
    refused by that validator before): tiny and fit keep the quotient."""
    cls = getattr(transformers, "FunAsrNanoConfig", None)
    if cls is None:
        pytest.skip("FunAsrNano is not in this transformers")
    config = fitting.tiny(cls)
    assert config.adaptor_config.intermediate_size == config.text_config.hidden_size // 4
    fit = fitting.fit(config, Need(tp=4, pp=4))
    assert fit.config.adaptor_config.intermediate_size == fit.config.text_config.hidden_size // 4


def test_a_multimodal_rotary_split_is_scaled_to_the_shrunk_head():
    from packaging.version import Version

    names = ["Cosmos3EdgeConfig"] + (["HYV4VLConfig"] if Version(transformers.__version__) >= Version("5.24.0") else [])
    for cls in (getattr(transformers, n) for n in names):
        text = fitting.tiny(cls).text_config
        rotary = getattr(text, "qk_rope_head_dim", None) or text.head_dim
        assert sum(text.rope_parameters["mrope_section"]) == rotary // 2, cls.__name__


def test_a_parent_plan_naming_a_sub_model_reaches_its_config():
    assert fitting._reaches({"language_model.layers.*.self_attn.q_proj": "colwise"}, "text_config")
    assert fitting._reaches({"model.vision_tower.blocks.*.attn.qkv": "colwise"}, "vision_config")
    assert not fitting._reaches({"multi_modal_projector.linear_1": "colwise"}, "vision_config")
    assert not fitting._reaches(None, "text_config")


def test_an_encoder_decoders_plans_on_its_two_halves_allow_tp_and_pp_and_fit_both():
    """T5Gemma keeps its plans on `encoder` and `decoder` (each built as a model of its own), none on the config or a
    `text_config`: the layouts its plans allow include TP and pipelines, and fitting splits both halves' heads."""
    from paracheck.adapters.transformers.mixin_cases import plan_layouts

    config = fitting.tiny(transformers.T5GemmaConfig)
    assert not getattr(config, "base_model_tp_plan", None) and not hasattr(config, "text_config")
    assert fitting.has_plan(config, "tp") and fitting.has_plan(config, "pp") and not fitting.has_plan(config, "ep")
    assert {"tp2", "pp2"} <= {layout.name for layout in plan_layouts(config, 2)}
    fit = fitting.fit(config, Need(tp=4, pp=4))
    assert fit.config.encoder.num_attention_heads % 4 == 0 and fit.config.decoder.num_attention_heads % 4 == 0
    assert fitting.refusal(fit.config, Need(tp=4, pp=4)) is None


def test_a_plan_of_its_own_reaches_a_sub_config_under_a_parent_without_one():
    """T5Gemma2's encoder config has no plan, its text config has one (so transformers splits the encoder's text
    model): fitting to tp=4 must reach it too. It fitted the decoder only, and tp4 raised on the encoder's 2 kv heads."""
    config = fitting.tiny(transformers.T5Gemma2Config)
    assert not getattr(config.encoder, "base_model_tp_plan", None)
    assert getattr(config.encoder.text_config, "base_model_tp_plan", None)
    assert any(m.key.startswith("encoder.text_config.") for m in fitting.misfits(config, Need(tp=4)))
    text = fitting.fit(config, Need(tp=4)).config.encoder.text_config
    assert text.num_attention_heads % 4 == 0 and text.num_key_value_heads % 4 == 0


def test_a_towers_depth_by_another_name_is_cut_and_its_index_lists_keep_each_kind_of_layer():
    """Qwen2.5-VL's vision tower (`depth` 32, full attention at blocks 7, 15, 23, 31, windowed elsewhere) is cut to a
    windowed block and a full-attention one; Qwen3-VL's (`depth` 27, deepstack taps at 8, 16, 24) to a plain block
    and a tapped one, with one deepstack merger; Qwen2-Audio's encoder (`encoder_layers` 32) to 2, Bart's two halves
    to 2 each."""
    qwen25 = tiny_of(transformers.Qwen2_5_VLConfig).vision_config
    assert (qwen25.depth, qwen25.fullatt_block_indexes) == (2, [1])
    qwen3 = tiny_of(transformers.Qwen3VLConfig).vision_config
    assert (qwen3.depth, qwen3.deepstack_visual_indexes) == (2, [1])
    assert tiny_of(transformers.Qwen2AudioConfig).audio_config.encoder_layers == 2
    bart = tiny_of(transformers.BartConfig)  # its 3 labels are keyed by class index, not by layer: all kept
    assert (bart.encoder_layers, bart.decoder_layers, len(bart.id2label)) == (2, 2, 3)


@settings(max_examples=40, deadline=None)
@given(old=st.integers(2, 40), data=st.data())
def test_index_lists_over_a_cut_stack_stay_distinct_below_its_depth_and_keep_each_kind(old, data):
    indexes = st.lists(st.integers(0, old - 1), min_size=1, max_size=old, unique=True).map(sorted)
    lists = {"fullatt_block_indexes": data.draw(indexes), "deepstack_visual_indexes": data.draw(indexes)}
    defaults = {"depth": old, "out_indices": [0], **lists}
    values = {}
    fitting._cut_depth(defaults, "depth", old, values, 2)
    new = values["depth"]
    assert 2 <= new <= min(old, 4) and "out_indices" not in values  # a backbone's stages are not its layers
    before = {tuple(i in v for v in lists.values()) for i in range(old)}
    after = {tuple(i in values[k] for k in lists) for i in range(new)}
    assert after == before  # each kind of layer kept (two lists make 4 kinds at most)
    for key in lists:
        assert values[key] == sorted(set(values[key])) and all(0 <= i < new for i in values[key]), (key, values)
