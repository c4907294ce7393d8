"""The transformers adapter's tasks, in process: a family's name and its task both ways, the labels each task's
batch carries, and where an image's placeholders go (hypothesis over padded rows)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from paracheck.adapters.transformers import images, inputs, tasks  # noqa: E402


@pytest.mark.parametrize("task", tasks.TASKS, ids=lambda t: t.key)
def test_a_family_name_carries_its_task_and_causal_lms_keep_bare_names(task):
    assert tasks.by_suffix("gpt_neox" + task.suffix) == ("gpt_neox", task)
    assert tasks.of_class_name(tasks.classes(task)["llava" if task is tasks.IMAGE_TEXT else "llama"]) is task
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


def _llava():
    from transformers import LlavaConfig

    from paracheck.adapters.transformers import fitting

    return images.prepared(fitting.tiny(LlavaConfig))


def test_a_family_without_an_image_builder_is_refused_by_name():
    from transformers import FuyuConfig

    with pytest.raises(images.NoBuilder, match="fuyu: the kit makes image inputs for .*llava.* only"):
        images.prepared(FuyuConfig())


#: One family per way a builder shapes its image or sets its config (the rest share one of these builders'
#: parts): the whole table runs in the 2-rank sweep, at ~1 s a family here on 2 cores.
SHAPES = ("llava", "vipllava", "paligemma", "gemma3", "mistral3", "idefics3", "llava_next", "qwen2_vl", "qwen2_5_vl",
          "llama4", "idefics2")


@pytest.mark.parametrize("model_type", SHAPES)
def test_each_builders_inputs_run_the_tiny_model_and_split_by_rows(model_type):
    """A builder's inputs run its family's tiny model on one process, and each data-parallel share of them (dim 0
    of every tensor, as `inputs.share` cuts them) gives that share's rows of the whole batch's logits."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from paracheck.adapters.transformers import fitting

    config = tasks.prepared(fitting.tiny(CONFIG_MAPPING[model_type]), tasks.IMAGE_TEXT)
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    batch = tasks.with_labels(tasks.IMAGE_TEXT, inputs.global_batch("left_pad", 2, config.get_text_config().vocab_size),
                              config, seed=1)
    with torch.no_grad():
        out = model(**batch, use_cache=False)
        rows = [model(**{k: v for k, v in inputs.share(batch, i, 2).items() if k != "labels"}, use_cache=False).logits
                for i in range(2)]
    assert torch.isfinite(out.loss)
    torch.testing.assert_close(torch.cat(rows), out.logits, atol=1e-5, rtol=1e-5)


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


def test_a_row_too_short_for_an_image_is_refused():
    config = _llava()
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="an image takes 4 placeholders"):
        images.with_images({"input_ids": ids}, config, seed=1)
