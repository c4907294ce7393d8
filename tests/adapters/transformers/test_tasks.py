"""The transformers adapter's tasks, in process: a family's name and its task both ways, the labels each task's
batch carries, where an image's placeholders go (hypothesis over padded rows), and a seq2seq batch's decoder
inputs and loss count (hypothesis over variants, data-parallel degrees and seeds)."""

import functools

import pytest
from packaging.version import Version
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from paracheck.adapters.transformers import coupling, images, inputs, refused, tasks  # noqa: E402


#: A model type each task's mapping holds (and no earlier task's, so its class names that task).
EXAMPLE = {tasks.IMAGE_TEXT: "llava", tasks.SEQ2SEQ: "t5gemma", tasks.AUDIO_TEXT: "qwen2_audio"}


@pytest.mark.parametrize("task", tasks.TASKS, ids=lambda t: t.key)
def test_a_family_name_carries_its_task_and_causal_lms_keep_bare_names(task):
    assert tasks.by_suffix("gpt_neox" + task.suffix) == ("gpt_neox", task)
    assert tasks.of_class_name(tasks.classes(task)[EXAMPLE.get(task, "llama")]) is task
    assert tasks.of_case("gpt_neox" + task.suffix, None) is task


def test_a_class_no_mapping_names_is_a_causal_lm():
    assert tasks.of_class_name("MyOwnModel") is tasks.CAUSAL_LM


def test_classification_labels_one_per_row_or_per_unpadded_token():
    batch = inputs.global_batch("base", 2, 128)
    per_row = tasks.with_labels(tasks.SEQUENCE_CLASSIFICATION, batch, None, seed=1)["labels"]
    assert per_row.shape == (2,) and int(per_row.max()) < tasks.NUM_LABELS
    padded = inputs.global_batch("left_pad", 2, 128)
    per_token = tasks.with_labels(tasks.TOKEN_CLASSIFICATION, padded, None, seed=1)["labels"]
    assert ((per_token == -100) == (padded["attention_mask"] == 0)).all()
    assert tasks.loss_kwargs(tasks.SEQUENCE_CLASSIFICATION, per_row) == {}
    assert tasks.loss_kwargs(tasks.CAUSAL_LM, batch["labels"]) == {"num_items_in_batch": 22}


def test_a_prepared_config_drops_nothing_so_train_mode_steps_can_match():
    """parity.steps trains in train mode: a token classifier's head dropout (0.1 by default where its config names
    none) would draw other masks on every process. Every task's prepared config has every dropout 0."""
    from transformers import LlamaConfig, LlamaForTokenClassification, T5GemmaConfig

    from paracheck.adapters.transformers import fitting

    config = tasks.prepared(fitting.tiny(LlamaConfig), tasks.TOKEN_CLASSIFICATION)
    assert LlamaForTokenClassification(config).dropout.p == 0.0
    seq2seq = fitting.tiny(T5GemmaConfig)
    seq2seq.encoder.dropout_rate = seq2seq.decoder.attention_dropout = 0.1
    seq2seq = tasks.prepared(seq2seq, tasks.SEQ2SEQ)
    assert seq2seq.encoder.dropout_rate == seq2seq.decoder.attention_dropout == 0.0
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "qianfan_ocr" in CONFIG_MAPPING:  # stochastic depth in its vision tower, 0.1 by default
        vlm = tasks.prepared(fitting.tiny(CONFIG_MAPPING["qianfan_ocr"]), tasks.IMAGE_TEXT)
        assert vlm.vision_config.drop_path_rate == 0.0


def _llava():
    from transformers import LlavaConfig

    from paracheck.adapters.transformers import fitting

    return images.prepared(fitting.tiny(LlavaConfig))


def test_a_family_without_an_image_builder_is_refused_by_name():
    from transformers import FuyuConfig

    with pytest.raises(refused.NoBuilder, match="fuyu: the kit makes image inputs for .*llava.* only"):
        images.prepared(FuyuConfig())


#: One family per way a builder shapes its image or sets its config (the rest share one of these builders'
#: parts): the whole table runs in the 2-rank sweep, at ~1 s a family here on 2 cores.
SHAPES = ("llava", "vipllava", "paligemma", "gemma3", "mistral3", "idefics3", "llava_next", "qwen2_vl", "qwen2_5_vl",
          "llama4", "idefics2", "ovis2", "llava_onevision1_5", "lfm2_vl",
          "janus", "hy_v4_vl", "granite_docling", "got_ocr2",
          # Tokens around the image (bounds) and an audio tower sized to build; a tower nested in a SAM encoder;
          # packed patches with a (height, width) grid; one two-frame patch per placeholder.
          "ovis2_5", "qwen2_5_omni_thinker", "unlimited_ocr", "nemotron_h_omni", "inkling_mm_model",
          # One image a row re-packed into the one strip its forward encodes, at the model's door.
          "minicpmv4_6")


@pytest.mark.parametrize("model_type", SHAPES)
def test_each_builders_inputs_run_the_tiny_model_and_split_by_rows(model_type):
    """A builder's inputs run its family's tiny model on one process, each data-parallel share of them (dim 0
    of every tensor, as `inputs.share` cuts them) gives that share's rows of the whole batch's logits, and other
    pixels give other logits."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from paracheck.adapters.transformers import fitting, sweep

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} registers no {model_type}")
    if model_type == "llama4" and Version(transformers.__version__) < Version("5.25.0"):
        pytest.skip("transformers 5.24's Llama4ForConditionalGeneration.forward reads `image_outputs` from its "
                    "language model's output, which has none (AttributeError on one process; 5.25.0 reads it no more)")
    config = tasks.prepared(fitting.tiny(CONFIG_MAPPING[model_type]), tasks.IMAGE_TEXT)
    torch.manual_seed(0)
    model = images.doored(transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval())
    sweep._nonzero_biases(model, zero_weights=True)  # as the sweep draws them: gemma3's projector starts at zero
    batch = tasks.with_labels(tasks.IMAGE_TEXT, inputs.global_batch("left_pad", 2, config.get_text_config().vocab_size),
                              config, seed=1)
    with torch.no_grad():
        out = model(**batch, use_cache=False)
        other = model(**dict(batch, pixel_values=torch.randn_like(batch["pixel_values"])), use_cache=False).logits
    assert torch.isfinite(out.loss)
    assert coupling.batch_apart(lambda i: coupling.alone(model, batch, i, 2), out.logits, 2, 1e-5, 1e-5) is None
    assert (other - out.logits).abs().max() > 1e-3  # the image reaches the text (GotOcr2's 1e-10 weights did not)


def test_minicpm_images_one_a_row_are_laid_into_one_strip_at_the_door_and_a_packed_batch_is_left():
    """MiniCPM-V encodes `pixel_values[:1]`: the door lays the kit's images (one a row, patches side by side along
    the last dim) end to end into that one row, in row order; a batch the processor packed (one row for all its
    images) or of one image reaches the model as it is."""
    door = images.BUILDERS["minicpmv4_6"].door
    rows = torch.arange(3 * 2 * 8.0).view(3, 1, 2, 8)
    sizes = torch.tensor([[1, 4]] * 3)
    strip = door({"pixel_values": rows, "target_sizes": sizes, "input_ids": torch.ones(3, 5)})
    assert strip["pixel_values"].shape == (1, 1, 2, 24) and strip["target_sizes"] is sizes
    assert all(torch.equal(strip["pixel_values"][0, :, :, 8 * r:8 * (r + 1)], rows[r]) for r in range(3))
    packed = {"pixel_values": torch.zeros(1, 3, 2, 24), "target_sizes": sizes}
    one = {"pixel_values": rows[:1], "target_sizes": sizes[:1]}
    assert door(packed) is packed and door(one) is one


def test_the_door_stands_at_forward_and_at_generate_of_a_family_that_has_one():
    """`generate` encodes the images before any forward (`get_image_features` on the whole `pixel_values`), so the
    door wraps it too; a family without a door is left as it is."""
    import types

    class Probe(torch.nn.Module):
        def __init__(self, model_type):
            super().__init__()
            self.config = types.SimpleNamespace(model_type=model_type)

        def forward(self, **kwargs):
            return tuple(kwargs["pixel_values"].shape)

        def generate(self, **kwargs):
            return tuple(kwargs["pixel_values"].shape)

    batch = {"pixel_values": torch.zeros(2, 3, 4, 16), "target_sizes": torch.tensor([[2, 2]] * 2)}
    doored = images.doored(Probe("minicpmv4_6"))
    assert doored(**batch) == doored.generate(**batch) == (1, 3, 4, 32)
    plain = images.doored(Probe("llava"))
    assert plain(**batch) == plain.generate(**batch) == (2, 3, 4, 16)


def test_hunyuan_vl_splits_by_rows_but_for_its_image_ordinal_counted_over_the_batch():
    """hunyuan_vl's declared upstream bug, pinned to its cause: its M-RoPE's last axis numbers each image over the
    whole batch (`get_rope_index`), so a data-parallel share's second row gets ordinal 0 where the whole batch's had
    1, and its logits differ; given the whole batch's positions with each row's ordinals counted from 0, the batch
    gives the shares' logits exactly. When transformers counts per row, the first assertion fails: the known-failures
    entries for hunyuan_vl go then (docs/upstream/transformers_hunyuan_vl_batch_image_index.md)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from paracheck.adapters.transformers import fitting, sweep

    if "hunyuan_vl" not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} registers no hunyuan_vl")
    config = tasks.prepared(fitting.tiny(CONFIG_MAPPING["hunyuan_vl"]), tasks.IMAGE_TEXT)
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    sweep._nonzero_biases(model, zero_weights=True)
    batch = tasks.with_labels(tasks.IMAGE_TEXT, inputs.global_batch("left_pad", 2, config.get_text_config().vocab_size),
                              config, seed=1)
    batch.pop("labels")
    shares = [inputs.share(batch, i, 2) for i in range(2)]

    def positions(b):
        return model.model.get_rope_index(b["input_ids"], b["mm_token_type_ids"], b["image_grid_thw"],
                                          b["attention_mask"])[0]

    per_row = positions(batch).clone()
    per_row[-1] = torch.cat([positions(share)[-1] for share in shares])  # each row's image ordinal as it alone has it
    with torch.no_grad():
        split = torch.cat([model(**share, use_cache=False).logits for share in shares])
        whole = model(**batch, use_cache=False).logits
        counted_per_row = model(**batch, position_ids=per_row, use_cache=False).logits
    assert (split - whole).abs().max() > 1e-5  # the bug: the second row's image is ordinal 1 in the whole batch
    torch.testing.assert_close(counted_per_row, split, atol=0, rtol=0)
    # what the kit measures where a data-parallel check fails, and types it by (the known entry's site)
    index, apart = coupling.batch_apart(lambda i: coupling.alone(model, batch, i, 2), whole, 2, 1e-5, 1e-5)
    assert index == 1 and apart == pytest.approx(float((split - whole)[1:].abs().max()))
    assert coupling.batch_apart(lambda i: coupling.alone(model, batch, i, 1), whole, 1, 1e-5, 1e-5) is None


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.booleans()), min_size=1, max_size=4))
def test_placeholders_sit_on_each_rows_first_tokens_and_the_loss_skips_them(rows):
    """Each row: its first unmasked positions hold the image's placeholders, one text token at least follows, no
    other position holds the placeholder id, and labels are -100 exactly on padding and placeholders."""
    config, length = _llava(), 12
    batch = inputs.global_batch("base", 1, config.text_config.vocab_size)
    ids = torch.randint(1, config.text_config.vocab_size, (len(rows), length), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    for row, (pad, left) in enumerate(rows):
        mask[row, :pad] = 0 if left else 1
        if not left and pad:
            mask[row, length - pad:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    out = images.with_images(batch, config, seed=1)
    count, token = images.placeholders(config), config.image_token_id
    for row in range(len(rows)):
        first = int(mask[row].nonzero()[0])
        assert (out["input_ids"][row, first:first + count] == token).all()
        assert int((out["input_ids"][row] == token).sum()) == count
    assert ((out["labels"] == -100) == ((mask == 0) | (out["input_ids"] == token))).all()
    assert out["pixel_values"].shape == (len(rows), images.CHANNELS, config.vision_config.image_size,
                                         config.vision_config.image_size)


@functools.lru_cache(maxsize=None)
def _bounded():
    """A family whose processor writes a token before and after each image (`Builder.bounds`)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from paracheck.adapters.transformers import fitting

    if "qwen2_5_omni_thinker" not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} registers no qwen2_5_omni_thinker")
    return tasks.prepared(fitting.tiny(CONFIG_MAPPING["qwen2_5_omni_thinker"]), tasks.IMAGE_TEXT)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 8), min_size=1, max_size=4), st.integers(0, 2 ** 16))
def test_an_images_bounding_tokens_sit_just_around_its_placeholders(pads, seed):
    """Each row (left-padded by any amount that leaves the image and one text token): the start token on its first
    unmasked position, the placeholders, then the end token; each once a row (the random text drew none of them),
    none of them in the loss but the bounds', which are text."""
    config, length = _bounded(), 12
    ids = torch.randint(1, config.text_config.vocab_size, (len(pads), length),
                        generator=torch.Generator().manual_seed(seed))
    mask = (torch.arange(length)[None] >= torch.tensor(pads)[:, None]).long()
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    out = images.with_images(batch, config, seed=1)
    count, token = images.placeholders(config), config.image_token_id
    start, end = config.vision_start_token_id, config.vision_end_token_id
    assert len({token, start, end}) == 3
    for row, pad in enumerate(pads):
        got = out["input_ids"][row].tolist()
        assert got[pad:pad + count + 2] == [start] + [token] * count + [end]
        assert (got.count(start), got.count(end), got.count(token)) == (1, 1, count)
    assert ((out["labels"] == -100) == ((mask == 0) | (out["input_ids"] == token))).all()


def test_a_row_too_short_for_an_image_is_refused():
    config = _llava()
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="an image takes 4 placeholders"):
        images.with_images({"input_ids": ids}, config, seed=1)


@functools.lru_cache(maxsize=None)
def _seq2seq(model_type: str, device: str = "cpu"):
    """The family's tiny seq2seq model, as the sweep prepares its config (no size changed: 2 ranks fit it); on
    the meta device where only its label shift is used."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from paracheck.adapters.transformers import fitting

    config = tasks.prepared(fitting.tiny(CONFIG_MAPPING[model_type]), tasks.SEQ2SEQ)
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.AutoModelForSeq2SeqLM.from_config(config, dtype=torch.float32).eval()


@settings(max_examples=15, deadline=None)
@given(st.sampled_from(("t5gemma", "t5gemma2")), st.sampled_from(tasks.SEQ2SEQ.variants), st.sampled_from((1, 2, 4)),
       st.integers(0, 1000))
def test_a_seq2seq_batch_shifts_its_labels_as_the_model_does(model_type, variant, dp, seed):
    """The decoder's inputs are the model's own shift of the labels; labels are -100 exactly on a padded variant's
    every second row's last `TARGET_PAD`; the loss counts every label but those (none shifted away)."""
    model = _seq2seq(model_type, "meta")
    batch = tasks.with_labels(tasks.SEQ2SEQ, inputs.global_batch(variant, dp, 128, seed), model.config, seed)
    labels = batch["labels"]
    assert labels.shape == (batch["input_ids"].shape[0], tasks.TARGET)
    assert torch.equal(batch["decoder_input_ids"], model.prepare_decoder_input_ids_from_labels(labels))
    expected = torch.zeros_like(labels, dtype=torch.bool)
    if variant != "base":
        expected[1::2, tasks.TARGET - tasks.TARGET_PAD:] = True
    assert torch.equal(labels == -100, expected)
    assert tasks.loss_kwargs(tasks.SEQ2SEQ, labels) == {"num_items_in_batch": int((~expected).sum())}


def test_a_seq2seq_models_shift_is_the_batchs_and_its_shares_losses_add_up_to_the_whole():
    """A forward given the labels alone (the model shifts them) equals one given the batch's decoder inputs, and
    each data-parallel share's loss, given the global count of labels, adds up to the whole batch's: the loss
    divides by `num_items_in_batch`, as a causal LM's does, so the kit sums the shares' losses."""
    model = _seq2seq("t5gemma")
    batch = tasks.with_labels(tasks.SEQ2SEQ, inputs.global_batch("left_pad", 2, 128), model.config, seed=1)
    counted = tasks.loss_kwargs(tasks.SEQ2SEQ, batch["labels"])
    with torch.no_grad():
        whole = model(**batch, use_cache=False).loss
        shifted_by_model = model(**{k: v for k, v in batch.items() if k != "decoder_input_ids"}, use_cache=False)
        shares = sum(model(**inputs.share(batch, i, 2), **counted, use_cache=False).loss for i in range(2))
        mean_of_shares = sum(model(**inputs.share(batch, i, 2), use_cache=False).loss for i in range(2)) / 2
    torch.testing.assert_close(shifted_by_model.loss, whole, atol=0, rtol=0)
    torch.testing.assert_close(shares, whole, atol=1e-6, rtol=1e-6)
    assert abs(float(mean_of_shares - whole)) > 1e-4  # the rows' label counts differ: a shard mean would be wrong


def test_a_seq2seq_class_that_is_no_encoder_decoder_is_refused_by_name():
    """The mapping's audio-LLMs (an audio encoder in front of a causal LM) are the audio-text task's, not this one's."""
    from transformers import Qwen2AudioConfig

    with pytest.raises(tasks.NotEncoderDecoder, match=r"qwen2_audio: not an encoder-decoder .*\(audio_config") as e:
        tasks.prepared(Qwen2AudioConfig(), tasks.SEQ2SEQ)
    assert e.value.why == tasks.NotEncoderDecoder.WHY  # one reason for every such family, as a report groups it


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.sampled_from([1, 2, 4]), st.integers(1, 5))
def test_a_share_of_packed_patches_holds_its_rows_images(per, dp, patches):
    """A tensor packing an equal block per row along dim 0 (every row's image patches in one sequence) is cut at
    the same rows as the per-row tensors: rank i's share holds exactly its rows' patches, in order."""
    rows = per * dp
    batch = {"input_ids": torch.arange(rows)[:, None].expand(rows, 3),
             "pixel_values": torch.arange(rows).repeat_interleave(patches)[:, None].float()}
    for index in range(dp):
        mine = inputs.share(batch, index, dp)
        assert mine["pixel_values"].shape[0] == per * patches
        assert mine["pixel_values"][:, 0].long().unique().tolist() == mine["input_ids"][:, 0].tolist()


def test_a_tensor_that_is_no_whole_block_per_row_is_refused_by_name():
    """Rows come from `input_ids`; a tensor whose dim 0 is not a whole multiple of them (unequal images, a
    (3, rows, seq) M-RoPE table) would hand a rank another row's entries or none: it raises, naming the tensor."""
    batch = {"input_ids": torch.zeros(4, 3, dtype=torch.long), "pixel_values": torch.zeros(6, 2)}
    with pytest.raises(ValueError, match="'pixel_values'.*6.*4 rows"):
        inputs.share(batch, 1, 2)
    with pytest.raises(ValueError, match="'position_ids'"):
        inputs.share({"position_ids": torch.zeros(3, 4, 2), "input_ids": torch.zeros(4, 2)}, 0, 2)


def test_every_multimodal_lm_class_with_a_plan_is_a_tasks_class_or_refused_by_name():
    """The multimodal-LM mapping's classes run under the task whose mapping names the same class; the rest are
    refused with a reason, and the refusals name no class a task already runs (nor a model type gone)."""
    from paracheck.adapters.transformers import multimodal

    found = multimodal.coverage()
    assert "unknown" not in found.values(), [k for k, v in found.items() if v == "unknown"]
    assert {k for k, v in found.items() if v.startswith("refused")} == set(multimodal.REFUSED)
    assert (found["qwen2_5_vl"], found["glmasr"], found["fuyu"]) == ("image-text", "audio-text", "causal-lm")


def test_a_checkpoint_of_a_shared_class_saved_after_a_load_reloads_whole(tmp_path):
    """Param2MoE's class is `Glm4MoeForCausalLM`, which its checkpoint's `architectures` names: loaded by that class
    alone, its config turned `Glm4MoeConfig`, and a save labelled the original-format weights `glm4_moe`, whose
    reload skipped Param2MoE's renames and left 17 tensors newly initialized (the sweep's checkpoint.roundtrip (a)
    on param2moe and sarvam_moe)."""
    import json

    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from paracheck.adapters.transformers import fitting

    if "param2moe" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no Param2MoE (new in 5.25)")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(fitting.tiny(CONFIG_MAPPING["param2moe"])).save_pretrained(tmp_path / "first")
    model = tasks.load(str(tmp_path / "first"), dtype=torch.float32)
    model.save_pretrained(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["model_type"] == "param2moe"
    back, info = tasks.load(str(tmp_path / "again"), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"]
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())


def test_a_data_parallel_failure_is_typed_rows_coupled_only_where_the_model_couples_and_the_layout_added_nothing():
    """`_Body._typed`'s rule on figures made here: a failing comparison is typed `ROWS_COUPLED` where a share run
    alone parts from its rows of the whole batch and the parallel result is that share's alone; not where the
    parallel logits part from the share's alone (a bug of the layout on such a model), not a raise or a
    non-finite figure, not a control's case, not without data parallelism, not where no share parts."""
    from types import SimpleNamespace

    from paracheck.adapters.transformers.body import _Body
    from paracheck.domain.records import CheckId, CheckResult, Status

    whole = torch.zeros(4, 3, 5)

    def body(dp=2, control=None, coupled=True):
        alone = {i: whole[i * 2:(i + 1) * 2] + (1e-3 if coupled and i == 1 else 0.0) for i in range(2)}
        return SimpleNamespace(layout=SimpleNamespace(dp=dp), control=control, expected={"infer": whole},
                               tol=SimpleNamespace(atol=1e-5, rtol=1e-5), _alone=alone.__getitem__)

    def failing(max_abs=1e-3):
        return CheckResult(CheckId.FORWARD, Status.FAIL, "logits differ", max_abs=max_abs)

    def typed(stub, check, agrees=lambda check: True):
        _Body._typed(stub, [check], agrees)
        return check.failure is not None and check.failure.site == coupling.ROWS_COUPLED

    check = failing()
    assert typed(body(), check) and "share 1's rows run alone differ from the whole batch's by 0.001" in check.detail
    assert not typed(body(), failing(), agrees=lambda check: False)  # the layout parted the logits from alone
    assert not typed(body(), failing(float("inf")))
    assert not typed(body(control="tf-vlm-tower-partial"), failing())
    assert not typed(body(dp=1), failing())
    assert not typed(body(coupled=False), failing())
