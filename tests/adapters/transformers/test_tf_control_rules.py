"""When a transformers control cannot show on a user's model, it says so before a rank plants it (a skip naming the
rule, never a `missed`): a router that sends every token to every expert, row-parallel biases that are all zero.
The rules in process, with hypothesis over configs, and over every causal-LM config class transformers registers."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from paracheck.adapters.transformers import controls  # noqa: E402


class Config:
    """A config with the given attributes only (and, nested, a `text_config`), as a family's may be."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


configs = st.builds(
    lambda experts, k, ekey, kkey, nested: (
        Config(text_config=Config(**{ekey: experts, kkey: k})) if nested else Config(**{ekey: experts, kkey: k}),
        experts, k),
    st.integers(1, 16), st.integers(1, 20), st.sampled_from(controls.EXPERT_KEYS),
    st.sampled_from(controls.TOP_K_KEYS), st.booleans())


@settings(max_examples=200, deadline=None)
@given(configs)
def test_a_router_control_is_refused_exactly_where_every_token_goes_to_every_expert(drawn):
    config, experts, k = drawn
    why = controls.every_expert_routed(config)
    assert (why is not None) == (k >= experts)
    if why:
        assert f"={k} of {experts} experts" in why and "picks the same experts" in why


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(controls.EXPERT_KEYS + controls.TOP_K_KEYS), st.integers(1, 8))
def test_a_config_naming_only_one_of_the_two_counts_leaves_the_control_on(key, value):
    assert controls.every_expert_routed(Config(**{key: value})) is None


def test_every_registered_causal_lm_config_reads_without_raising_and_its_defaults_route_a_subset():
    """Every config class in transformers' causal-LM mapping, at its defaults: the rule reads it, and no default MoE
    with several experts sends every token to all of them (HunYuan-MoE's defaults hold one expert, refused rightly;
    the sweep's fitted config holds four)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    refused = []
    for name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            config = CONFIG_MAPPING[name]()
        except Exception:  # a class whose defaults do not build (the sweep names these)
            continue
        if controls.every_expert_routed(config) and controls._expert_count(config) > 1:
            refused.append(name)
    assert refused == [], refused


def _tiny_neox(bias: float):
    import torch

    config = transformers.GPTNeoXConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                        intermediate_size=64)
    model = transformers.GPTNeoXForCausalLM(config)
    model.tp_plan  # the row-parallel modules are read from the plan
    with torch.no_grad():
        for module in controls._rowwise_with_bias(model):
            module.bias.fill_(bias)
    return model


@settings(max_examples=10, deadline=None)
@given(st.floats(-1.0, 1.0).filter(lambda b: abs(b) > 1e-30))  # nonzero in float32
def test_the_bias_control_runs_on_any_nonzero_bias_and_is_refused_on_zeros(bias):
    assert controls._bias_shows(_tiny_neox(bias)) is None
    why = controls._bias_shows(_tiny_neox(0.0))
    assert why is not None and "all exactly zero" in why


def test_a_model_without_a_row_parallel_bias_says_so():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                      intermediate_size=64)
    assert "no row-parallel module with a bias" in controls._bias_shows(transformers.LlamaForCausalLM(config))


def test_the_cache_control_plants_only_in_the_attentions_tp_splits(tp_mesh_of_one):
    """tf-cache-all-heads bends the attentions whose cached keys and values the TP plan splits by head; an
    encoder-decoder's cross-attention, which T5Gemma's plan leaves whole on every rank, is left as it is (it has
    no other rank's heads to read)."""
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    from paracheck.adapters.transformers import fitting

    with torch.device("meta"):
        model = transformers.T5GemmaForConditionalGeneration(fitting.tiny(transformers.T5GemmaConfig))
    for layer in [*model.model.encoder.layers, *model.model.decoder.layers]:  # as the plan shards them: colwise
        for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
            proj.weight = torch.nn.Parameter(distribute_tensor(torch.zeros(proj.weight.shape), tp_mesh_of_one,
                                                               [Shard(0)]))
    controls._cache_first_heads(model, None)
    bent = {name.split(".")[-1] for name, m in model.named_modules() if "forward" in vars(m)}
    assert bent == {"self_attn"}
    assert all("forward" not in vars(layer.cross_attn) for layer in model.model.decoder.layers)


def _meta_llama():
    import torch

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                      intermediate_size=64)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


_LLAMA: dict = {}
_STYLES = ("colwise", "colwise_gather_output", "unit_colwise", "packed_colwise", "rowwise", "replicate", None)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(_STYLES), st.sampled_from(_STYLES), st.sampled_from(_STYLES))
def test_the_cache_control_is_refused_exactly_where_no_key_or_value_projection_keeps_its_heads_split(q, k, v):
    """Whatever the plan does to the queries, the control shows only where a key or value projection's output stays
    split by head on each rank (what the cache holds); otherwise it is refused by name, never planted to be
    `missed` (a family whose plan gathers every head back, or splits no attention, as qwen3_vl's 5.25 text plan)."""
    model = _LLAMA.setdefault("model", _meta_llama())  # one model, its plan redrawn
    styles = {"q_proj": q, "k_proj": k, "v_proj": v}
    model._tp_plan = {f"model.layers.*.self_attn.{p}": s for p, s in styles.items() if s is not None}
    why = controls._cache_heads_split(model)
    if k in controls.HEADS_SPLIT or v in controls.HEADS_SPLIT:
        assert why is None and len(controls.split_attentions(model)) == 1
    else:
        assert "splits no attention's cached keys and values" in why


def test_the_cache_control_reads_the_families_own_plans():
    """On transformers' own plans: llama's colwise keys and values show the plant; olmo2's colwise_gather_output
    gathers every head back, so the control is refused by name."""
    import torch

    from paracheck.adapters.transformers import fitting

    assert controls._cache_heads_split(_meta_llama()) is None
    with torch.device("meta"):
        olmo2 = transformers.Olmo2ForCausalLM(fitting.tiny(transformers.Olmo2Config))
    assert "colwise_gather_output" not in controls.HEADS_SPLIT
    assert "splits no attention's cached keys and values" in controls._cache_heads_split(olmo2)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(("embedding_rowwise", "embedding_colwise", "replicate", None)),
       st.sampled_from(("colwise_gather_output", "rowwise_split_input", "replicate", None)))
def test_the_replicate_controls_are_refused_where_the_plan_already_keeps_the_module_whole(embed, head):
    """tf-embed-replicate and tf-vlm-head-unplanned plan a module `replicate`: where the plan names it under no key
    or already plans it so (inkling's text plans keep `embed_tokens` replicate), the plant would change nothing,
    so the control is refused by name instead of reading `missed`."""
    model = _LLAMA.setdefault("model", _meta_llama())
    rules = {"model.embed_tokens": embed, "lm_head": head}
    model._tp_plan = {k: v for k, v in rules.items() if v is not None}
    splits = {"model.embed_tokens": embed not in (None, "replicate"), "lm_head": head not in (None, "replicate")}
    assert controls._embedding_replicated(model) == ({"model.embed_tokens": "replicate"} if splits["model.embed_tokens"]
                                                     else {})
    assert controls._head_replicated(model) == ({"lm_head": "replicate"} if splits["lm_head"] else {})
    why = controls._embedding_shows(model)
    assert (why is None) == splits["model.embed_tokens"], why  # llama's head is untied
    if not splits["model.embed_tokens"]:
        assert "does not split its input embedding" in why


def test_the_bias_control_is_refused_on_a_layout_that_splits_no_biased_module_by_rows(tp_mesh_of_one):
    """After the load: a biased linear split by input rows on tp takes the plant; where the layout splits none so
    (a colwise one only, or experts an EP layout dispatches), the control is refused by name, not planted."""
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    from paracheck.domain.adapter import Refused

    class Layout:
        tp = 2

        def __str__(self):
            return "tp2xfsdp2xep2"

    def linear(dim):
        module = torch.nn.Linear(4, 4)
        module.weight = torch.nn.Parameter(distribute_tensor(module.weight.detach(), tp_mesh_of_one, [Shard(dim)]))
        return module

    colwise = torch.nn.Sequential(linear(0))
    with pytest.raises(Refused, match="splits no module with a bias by input rows"):
        controls._bias_before_reduce(colwise, Layout())
    rowwise = torch.nn.Sequential(linear(0), linear(1))
    controls._bias_before_reduce(rowwise, Layout())
    assert [bool(m._forward_hooks) for m in rowwise] == [False, True]


_LLAVAS: dict = {}


def _tiny_llava(layers: int, feature_layer: int):
    """A real tiny Llava (CLIP tower of `layers` layers, read at `feature_layer`), built once per tower depth."""
    import torch

    if layers not in _LLAVAS:
        torch.manual_seed(0)
        _LLAVAS[layers] = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
            vision_config=dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=24, image_size=8,
                               patch_size=4, num_hidden_layers=layers, num_attention_heads=2),
            text_config=dict(model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=32,
                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2),
            image_token_id=63)).eval()
    model = _LLAVAS[layers]
    model.config.vision_feature_layer = feature_layer
    return model


def test_the_tower_control_plants_in_the_layer_whose_output_the_projector_reads():
    """`vision_feature_layer` indexes the tower's hidden states: for every index of a 3-layer tower, the layer found
    is the one whose output is that hidden state (read back from one real forward); index 0 is the embeddings, no
    layer, so the control is refused there."""
    import torch

    model, layers = _tiny_llava(3, -1), 3
    outputs = {}
    hooks = [layer.register_forward_hook(lambda m, args, out, i=i: outputs.__setitem__(i, out[0] if isinstance(
        out, tuple) else out)) for i, layer in enumerate(model.model.vision_tower.encoder.layers)]
    with torch.no_grad():
        states = model.model.vision_tower(torch.randn(1, 3, 8, 8), output_hidden_states=True).hidden_states
    for hook in hooks:
        hook.remove()
    for index in range(-layers, layers + 1):
        model.config.vision_feature_layer = index
        found = controls._tower_read_layer(model)
        if index == 0:
            assert found is None and "no vision tower feeding" in controls._tower_feeds_projector(model)
            continue
        name, layer = found
        position = index - 1 if index > 0 else layers + index
        assert name == f"model.vision_tower.encoder.layers.{position}", (index, name)
        assert torch.equal(outputs[position], states[index])
        assert controls._tower_feeds_projector(model) is None


@pytest.mark.parametrize("tp", [2, 3])
def test_the_tower_control_leaves_each_rank_a_partial_sum_of_the_whole(tp, monkeypatch):
    """Planted, the read layer's last projection returns this rank's row-parallel partial sum: over the ranks the
    partial sums add up to the whole output plus the bias counted tp - 1 more times, and no rank's is the whole."""
    import copy

    import torch

    outputs, x = [], torch.randn(2, 5, 24)
    for rank in range(tp):
        model = copy.deepcopy(_tiny_llava(2, -2))
        monkeypatch.setattr(controls, "_tp_coordinate", lambda m, rank=rank: (rank, tp))
        assert controls._tower_left_partial(model, None) == "model.vision_tower.encoder.layers.0"
        fc2 = model.model.vision_tower.encoder.layers[0].mlp.fc2
        with torch.no_grad():
            outputs.append(fc2(x))
    whole = torch.nn.functional.linear(x, fc2.weight, fc2.bias).detach()
    assert torch.allclose(sum(outputs), whole + (tp - 1) * fc2.bias.detach(), atol=1e-6)
    assert not any(torch.allclose(o, whole) for o in outputs)


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 4), st.lists(st.booleans(), min_size=4, max_size=13))
def test_the_placeholder_control_keeps_each_rank_its_share_of_the_placeholders(tp, marks):
    """Each rank's mask is the whole mask on its contiguous share of the row and nothing elsewhere: the shares
    cover the row once, so over the ranks every placeholder is marked exactly once."""
    import copy

    import torch

    ids = torch.tensor([[63 if m else 1 for m in marks]])
    embeds, features = torch.zeros(1, len(marks), 16), torch.zeros(sum(marks), 16)
    masks = []
    for rank in range(tp):
        model = copy.deepcopy(_tiny_llava(1, -1))
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(controls, "_tp_coordinate", lambda m, rank=rank: (rank, tp))
            assert controls._placeholders_on_shard(model, None) == "model"
        mine = model.model.get_placeholder_mask(ids, embeds, features)[0, :, 0]
        share = controls._share(len(marks), rank, tp)
        assert not mine[:share.start].any() and not mine[share.stop:].any()
        masks.append(mine.long())
    assert torch.equal(sum(masks), ids[0].eq(63).long())
    assert (controls._placeholders_shown(model) is None) and (controls._tower_feeds_projector(model) is None)


def test_both_vision_language_controls_are_refused_by_name_on_a_causal_lm():
    llama = _meta_llama()
    assert "no vision tower feeding a multi_modal_projector" in controls._tower_feeds_projector(llama)
    assert "marks no image placeholder tokens" in controls._placeholders_shown(llama)


def test_the_placeholder_control_is_refused_on_inputs_without_an_image():
    """A user's batch with no image in any row (through a mixin) cannot show placeholders misplaced: refused by
    name before the run, never reported missed; a batch with one placeholder is planted."""
    import torch

    model = _tiny_llava(1, -1)
    plant = controls.PLANTS["tf-vlm-placeholders-on-shard"]
    assert "no image placeholder token" in plant.needs_inputs(model, {"input_ids": torch.tensor([[1, 2, 3]])})
    assert plant.needs_inputs(model, {"input_ids": torch.tensor([[1, 63, 3]])}) is None


def test_the_placeholder_control_bends_the_image_mask_of_a_family_returning_several(monkeypatch):
    """Families that take videos (or audio) too return (image, video, ...) masks: the image's is bent, the others
    are handed on as they were."""
    import copy

    import torch

    model = copy.deepcopy(_tiny_llava(1, -1))
    owner, whole = model.model, model.model.get_placeholder_mask
    monkeypatch.setattr(owner, "get_placeholder_mask", lambda *a, **k: (whole(*a, **k), None))
    monkeypatch.setattr(controls, "_tp_coordinate", lambda m: (1, 2))
    controls._placeholders_on_shard(model, None)
    ids = torch.tensor([[63, 63, 1, 1, 63, 1]])
    image, video = owner.get_placeholder_mask(ids, torch.zeros(1, 6, 16), torch.zeros(3, 16))
    assert video is None and image[0, :, 0].tolist() == [False, False, False, False, True, False]
