"""The audio-text task's inputs, in process: which seq2seq classes it takes, each builder's clip against its tiny
model (the placeholders its features fill, the rows a data-parallel share keeps), where the placeholders go
(hypothesis over padded rows and configs' clips), and the classes whose loss is a plain mean."""

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from paracheck.adapters.transformers import audio, fitting, inputs, refused, tasks  # noqa: E402


def _config(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} registers no {model_type}")
    return tasks.prepared(fitting.tiny(CONFIG_MAPPING[model_type]), tasks.AUDIO_TEXT)


@functools.lru_cache(maxsize=None)
def _built(model_type: str):
    """(prepared config, tiny model), built once per module run."""
    config = _config(model_type)
    torch.manual_seed(0)
    auto = getattr(transformers, tasks.auto_class(tasks.AUDIO_TEXT, model_type))
    return config, auto.from_config(config, dtype=torch.float32).eval()


def test_the_seq2seq_mapping_splits_into_encoder_decoders_and_audio_front_ends_each_built_or_refused():
    """Every class of the seq2seq mapping is one task's: the encoder-decoders seq2seq's, the rest audio-text's, which
    also takes the speech seq2seq mapping's classes of that kind, each built by its own mapping's auto class; every
    audio-text model type with a TP plan has a builder or a named refusal (a new release's family fails here, not in
    a sweep)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from paracheck.adapters.transformers.sweep import planned

    seq2seq, audio_text = tasks.classes(tasks.SEQ2SEQ), tasks.classes(tasks.AUDIO_TEXT)
    assert "t5gemma" in seq2seq and "qwen2_audio" in audio_text and not set(seq2seq) & set(audio_text)
    assert tasks.of_class_name(audio_text["qwen2_audio"]) is tasks.AUDIO_TEXT
    assert tasks.auto_class(tasks.AUDIO_TEXT, "qwen2_audio") == "AutoModelForSeq2SeqLM"
    if "fun_asr_nano" in CONFIG_MAPPING:  # the speech seq2seq mapping's alone (transformers 5.25)
        assert tasks.auto_class(tasks.AUDIO_TEXT, "fun_asr_nano") == "AutoModelForSpeechSeq2Seq"
        assert {"fun_asr_nano", "vibevoice"} <= set(audio_text) and "whisper" not in audio_text
    with_plan = {k for k in audio_text if planned(CONFIG_MAPPING[k], tasks.AUDIO_TEXT)}
    assert with_plan <= set(audio.BUILDERS) | set(audio.REFUSED)


def test_a_family_without_an_audio_builder_is_refused_by_name():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "voxtral_realtime" in CONFIG_MAPPING:
        with pytest.raises(refused.NoBuilder, match="voxtral_realtime: a streaming model with no placeholders"):
            tasks.refuse(CONFIG_MAPPING["voxtral_realtime"](), tasks.AUDIO_TEXT)
    with pytest.raises(refused.NoBuilder, match="llama: the kit makes audio inputs for .*qwen2_audio.* only"):
        tasks.refuse(transformers.LlamaConfig(), tasks.AUDIO_TEXT)


#: One family per way a builder shapes its clip (Whisper's frames and mask, a Q-Former's windows, a raw waveform,
#: stacked frames kept one a placeholder and built by the speech seq2seq auto class);
#: the rest share these builders' parts, and every family runs in the sweep on real ranks.
SHAPES = ("qwen2_audio", "granite_speech", "omniasr", "fun_asr_nano")


@pytest.mark.parametrize("model_type", SHAPES)
def test_each_builders_clip_fills_its_placeholders_and_splits_by_rows(model_type):
    """A builder's clip runs its family's tiny model: its encoder gives exactly `TOKENS` features a row (what the
    placeholders ask), each data-parallel share of the inputs gives that share's rows of the whole batch's logits,
    and another clip gives other logits."""
    config, model = _built(model_type)
    batch = tasks.with_labels(tasks.AUDIO_TEXT, inputs.global_batch("left_pad", 2, config.get_text_config().vocab_size),
                              config, seed=1)
    clip = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask", "labels")}
    key = "input_values" if "input_values" in clip else "input_features"
    with torch.no_grad():
        out = model(**batch, use_cache=False)
        rows = [model(**{k: v for k, v in inputs.share(batch, i, 2).items() if k != "labels"}, use_cache=False).logits
                for i in range(2)]
        other = model(**dict(batch, **{key: torch.randn_like(clip[key])}), use_cache=False).logits
    assert int((batch["input_ids"] == config.audio_token_id).sum()) == 2 * audio.TOKENS
    assert torch.isfinite(out.loss)
    torch.testing.assert_close(torch.cat(rows), out.logits, atol=1e-5, rtol=1e-5)
    assert (other - out.logits).abs().max() > 1e-5  # the clip reaches the text


@settings(max_examples=12, deadline=None)
@given(st.sampled_from(sorted(audio.BUILDERS)), st.sampled_from(tasks.AUDIO_TEXT.variants), st.sampled_from((1, 2, 4)),
       st.integers(0, 1000))
def test_placeholders_sit_on_each_rows_first_tokens_and_the_clip_is_the_configs(model_type, variant, dp, seed):
    """Each row's first `TOKENS` real tokens are the placeholder and no other token is; labels are -100 there and on
    padding, the rest the row's own; the clip's tensors have one entry per row, of the prepared config's frames and
    mel bins."""
    config = _config(model_type)
    batch = inputs.global_batch(variant, dp, config.get_text_config().vocab_size, seed)
    out = tasks.with_labels(tasks.AUDIO_TEXT, batch, config, seed)
    ids, mask = out["input_ids"], batch.get("attention_mask", torch.ones_like(batch["input_ids"]))
    expected = torch.zeros_like(ids, dtype=torch.bool)
    for row in range(ids.shape[0]):
        first = int(mask[row].nonzero()[0])
        expected[row, first:first + audio.TOKENS] = True
    assert torch.equal(ids == config.audio_token_id, expected)
    assert torch.equal(out["labels"] == -100, expected | (mask == 0))
    build, rows = audio.builder(config), ids.shape[0]
    assert all(v.shape[0] == rows for v in out.values())
    if "input_features" in out and model_type not in audio.FEATURES:
        frames, bins = build.frames(config), build.bins(config)
        assert tuple(out["input_features"].shape[1:]) == ((frames, bins) if build.nemo else (bins, frames))
    assert tasks.loss_kwargs(tasks.AUDIO_TEXT, out["labels"]) == {"num_items_in_batch":
                                                                 inputs.predicted_tokens(out["labels"])}


def test_the_mean_loss_classes_read_no_item_count_and_the_others_do():
    """`tasks.own_mean_loss` against the library: those classes' loss is the same whatever `num_items_in_batch` says (a
    shard mean), another's divides by it; the Trainer's steps name the former's scaled loss by its declared cause."""
    from paracheck.adapters.transformers import steps

    for model_type, mean in (("qwen2_audio", True), ("omniasr", False)):  # built above: no third family to build
        config, model = _built(model_type)
        batch = tasks.with_labels(tasks.AUDIO_TEXT, inputs.global_batch("base", 1, config.get_text_config().vocab_size),
                                  config, seed=1)
        with torch.no_grad():
            given_1, given_2 = (model(**batch, num_items_in_batch=n, use_cache=False).loss for n in (1, 2))
        assert tasks.own_mean_loss(model) is mean and tasks.shard_mean(tasks.AUDIO_TEXT, model) is mean
        assert ("left_pad" in tasks.variants(tasks.AUDIO_TEXT, model)) is not mean  # unequal shards' means
        assert steps._mean_loss_head(model) is mean  # the Trainer's dp-scaled mean loss, the declared failure's cause
        assert torch.equal(given_1, given_2) is mean, model_type
