"""A vision-language model's image inputs, made with no download: the image size a tiny config is given, the
placeholder tokens each row carries for its image, and the pixels.

What a family's processor would produce is family-specific (how many placeholders an image becomes, which tensors
besides `pixel_values` its forward takes), so each family the kit builds inputs for is named in `BUILDERS`; any
other is refused before launch with `NoBuilder`, naming the families it knows.
"""

from __future__ import annotations

import copy

#: Patches per side of the kit's square image: 4 patches, so 4 placeholders per image where one placeholder stands
#: for one patch feature.
SIDE = 2
CHANNELS = 3
#: The text token the random ids fall back to where they drew the placeholder's id.
TEXT_ID = 1


class NoBuilder(ValueError):
    """A vision-language family whose image inputs the kit cannot make."""


def _patch_grid(config) -> int:
    """A CLIP-style tower whose every patch feature is one placeholder (its class token dropped under the
    "default" feature strategy, kept under "full"): the image is `SIDE` patches square."""
    vision = config.vision_config
    vision.image_size = vision.patch_size * SIDE
    return SIDE * SIDE + (getattr(config, "vision_feature_select_strategy", "default") == "full")


#: model type -> (config -> placeholders per image, after making the config's image `SIDE` patches square).
BUILDERS = {"llava": _patch_grid}


def text_config(config):
    return getattr(config, "text_config", None) or config


def prepared(config):
    """A copy of `config` whose image is `SIDE` patches square, whose placeholder token is the last of the text
    vocabulary (a token the random text never draws) and whose image sequence length matches; `NoBuilder` names a
    family the kit makes no image inputs for."""
    builder = BUILDERS.get(config.model_type)
    if builder is None:
        raise NoBuilder(f"{config.model_type}: the kit makes image inputs for {', '.join(sorted(BUILDERS))} only "
                        "(each family's processor turns an image into its own placeholders and tensors)")
    config = copy.deepcopy(config)
    count = builder(config)
    config.image_token_id = text_config(config).vocab_size - 1
    config.image_seq_length = count
    return config


def placeholders(config) -> int:
    return config.image_seq_length


def with_images(batch: dict, config, seed: int) -> dict:
    """`batch` with one image per row: `placeholders(config)` placeholder tokens from each row's first unmasked
    position (at least one text token left after them), the pixels, and labels -100 on the placeholders (a
    vision-language loss predicts text only). Rows too short for an image raise ValueError."""
    import torch

    ids, token, count = batch["input_ids"].clone(), config.image_token_id, placeholders(config)
    ids[ids == token] = TEXT_ID
    mask = batch.get("attention_mask", torch.ones_like(ids))
    image = torch.zeros_like(ids, dtype=torch.bool)
    for row in range(ids.shape[0]):
        real = mask[row].nonzero().flatten()
        if len(real) < count + 1:
            raise ValueError(f"row {row} has {len(real)} tokens: an image takes {count} placeholders and one text "
                             "token follows them")
        image[row, int(real[0]):int(real[0]) + count] = True
    ids[image] = token
    size = config.vision_config.image_size
    pixels = torch.randn(ids.shape[0], CHANNELS, size, size, generator=torch.Generator().manual_seed(seed + 2))
    out = dict(batch, input_ids=ids, pixel_values=pixels)
    if "labels" in batch:
        out["labels"] = ids.masked_fill((batch["labels"] == -100) | image, -100)
    return out
