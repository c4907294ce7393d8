"""`checks.traits.input_traits`: one rule for what both libraries' inputs carry for known-failure entries."""

import torch

from paracheck.checks.traits import input_traits


def test_a_mask_that_masks_something_is_padded_and_one_of_ones_is_only_a_mask():
    assert input_traits({"hidden_states": torch.ones(1, 4)}) == []
    assert input_traits({"encoder_attention_mask": torch.ones(1, 4, dtype=torch.bool)}) == ["mask"]
    assert input_traits({"encoder_attention_mask": torch.tensor([[True, False]])}) == ["mask", "padded"]


def test_transformers_batches_are_read_by_the_same_rule():
    from paracheck.adapters.transformers import inputs

    assert input_traits(inputs.global_batch("base", 1, 128)) == []
    assert input_traits(inputs.global_batch("packed", 1, 128)) == []
    assert input_traits(inputs.global_batch("left_pad", 1, 128)) == ["mask", "padded"]
