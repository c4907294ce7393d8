"""A vision-language model's image inputs, made with no download: the image size a tiny config is given, the
placeholder tokens each row carries for its image, and the pixels and other per-row tensors its forward takes.

What a family's processor would produce is family-specific (how many placeholders an image becomes, which tensors
besides `pixel_values` its forward takes), so each family the kit builds inputs for has a `Builder` in `BUILDERS`;
a family known not to fit the kit's inputs is in `REFUSED` with its reason, any other is refused before launch with
`NoBuilder`, naming the families it knows. Every tensor a builder adds has one entry per row (dim 0), so
`inputs.share` splits it over data-parallel ranks as it splits the token rows; a family whose forward takes a
batch's images otherwise (MiniCPM-V: all in one row) has a door that re-packs them as its processor would, on every
model the kit loads (`doored`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

from paracheck.adapters.transformers import inputs
from paracheck.adapters.transformers.refused import lookup

#: Placeholders per side of the kit's square image: 4 placeholders per image (a family that merges patches gets an
#: image of `SIDE * merge` patches a side).
SIDE = 2
CHANNELS = 3


@dataclass(frozen=True)
class Builder:
    """One family's image, as its processor would shape it for a square image of `merge * SIDE` patches a side."""
    #: Patches merged per side into one placeholder (a pixel shuffle, a pooling, a spatial merge): 1 for none.
    merge: int = 1
    #: Placeholders per side of the image before `more`: fewer than `SIDE` where an image's placeholders must
    #: still fit a padded row.
    side: int = SIDE
    #: (config, side) -> placeholders per image beyond `side * side` (a kept class token, newline features).
    more: Callable = lambda config, side: 0
    #: (config) -> None: the family's own fields for that image (a pooling's token count, an anyres grid).
    configure: Callable = lambda config: None
    #: Tiles per image: 0 for `pixel_values` (rows, 3, size, size), n for (rows, n, 3, size, size).
    tiles: int = 0
    sizes: bool = False  # `image_sizes` (rows, 2): each image's height and width in pixels
    #: (key, on) where the processor marks tokens: `key` 1 on "image" placeholders or on "text", else None.
    token_types: tuple[str, str] | None = None
    #: (config, rows, size, generator) -> the image tensors, where they are not `pixel_values` of whole images.
    pixels: Callable | None = None
    #: (config) -> the vision config that holds the image and patch sizes (a SAM encoder's, nested in the tower's).
    tower: Callable = lambda config: config.vision_config
    #: The config's names of the tokens its processor writes just before and just after an image's placeholders
    #: (a vision start read by M-RoPE, begin and end indicators given features of their own), None for none.
    bounds: tuple[str | None, str | None] = (None, None)
    #: (forward kwargs) -> forward kwargs: the batch's images re-packed as the family's processor packs a batch's,
    #: at the model's door (`doored`), where its forward takes every image in one tensor row; None for none.
    door: Callable | None = None


def _vision_size(config, size: int) -> None:
    vision = builder(config).tower(config)
    vision.image_size = [size, size] if isinstance(getattr(vision, "image_size", None), (list, tuple)) else size


def _patch(config) -> int:
    patch = builder(config).tower(config).patch_size
    return patch[0] if isinstance(patch, (list, tuple)) else patch


def _gemma3(config) -> None:
    config.mm_tokens_per_image = SIDE * SIDE


def _paligemma(config) -> None:
    """The projector maps the tower's features to `projection_dim`, which must be the (fitted) text width."""
    config.projection_dim = config.vision_config.projection_dim = text_config(config).hidden_size


def _janus(config) -> None:
    """Janus's aligner maps the tower's features to the vision config's `projection_dim`, which must be the
    (fitted) text width. Its VQ image tokenizer and generation head (for image output, which the kit does not
    run, but built with the model) keep their real sizes, which the tiny rule does not know: two levels of 32
    channels, 64 codes, and the text width where they meet the text."""
    width = text_config(config).hidden_size
    config.vision_config.projection_dim = width
    vq = config.vq_config
    vq.base_channels, vq.channel_multiplier, vq.num_res_blocks, vq.latent_channels = 32, [1, 1], 1, 32
    vq.num_embeddings, vq.projection_dim, vq.image_token_embed_dim = 64, width, width
    vq.num_patches = image_size(config) // _patch(config)  # the config derives it from the real image at init


def _pixtral(config) -> None:
    """Pixtral's rotary tables take `head_dim`, which must be the (fitted) tower's width per head."""
    vision = config.vision_config
    vision.head_dim = vision.hidden_size // vision.num_attention_heads


def _vipllava(config) -> None:
    """The tiny tower's last two layers (the default names five layers of a 24-layer tower)."""
    config.vision_feature_layer = [-2, -1]


def _patches(config, rows: int, size: int, generator) -> dict:
    """Qwen-VL's flattened patches: `pixel_values` (rows, patches, channels x temporal x patch x patch), one
    image per row, and `image_grid_thw` (rows, 3). The processor's layout is (all images' patches, ...); the
    tower reads it through `view(-1, ...)`, so a row-major (rows, patches, ...) is the same tensor, and one whose
    dim 0 `inputs.share` splits by rows."""
    import torch

    vision, grid = config.vision_config, size // _patch(config)
    # Towers name their channels `num_channels` or `in_channels` (Muse's neither: RGB), their frames per patch
    # `temporal_patch_size` or `patch_temporal` (one that embeds one frame neither).
    channels = getattr(vision, "in_channels", None) or getattr(vision, "num_channels", None) or CHANNELS
    temporal = getattr(vision, "temporal_patch_size", None) or getattr(vision, "patch_temporal", None) or 1
    flat = channels * temporal * _patch(config) ** 2
    return {"pixel_values": torch.randn(rows, grid * grid, flat, generator=generator),
            "image_grid_thw": torch.tensor([[1, grid, grid]] * rows)}


def _packed(config, rows: int, size: int, generator) -> dict:
    """Qwen-VL's patches as its processor gives them, every row's in one sequence: `pixel_values` (rows x patches,
    channels x temporal x patch x patch) for a tower that reads them without a `view`. Each row's image is the same
    size, so `inputs.share` cuts the sequence at images."""
    out = _patches(config, rows, size, generator)
    return dict(out, pixel_values=out["pixel_values"].flatten(0, 1))


def _packed_images(config, rows: int, size: int, generator) -> dict:
    """Every row's patches in one sequence as images: `pixel_values` (rows x patches, channels, patch, patch) and
    `image_grid_thw` (rows, 3). Each row's image is the same size, so `inputs.share` cuts the sequence at images."""
    import torch

    patch, grid = _patch(config), size // _patch(config)
    return {"pixel_values": torch.randn(rows * grid * grid, CHANNELS, patch, patch, generator=generator),
            "image_grid_thw": torch.tensor([[1, grid, grid]] * rows)}


def _packed_hw(config, rows: int, size: int, generator) -> dict:
    """Every row's flattened patches in one sequence, one frame each: `pixel_values` (rows x patches, channels x patch
    x patch) and `image_grid_hw` (rows, 2). Each row's image is the same size, so `inputs.share` cuts it at images."""
    import torch

    patch, grid = _patch(config), size // _patch(config)
    return {"pixel_values": torch.randn(rows * grid * grid, CHANNELS * patch * patch, generator=generator),
            "image_grid_hw": torch.tensor([[grid, grid]] * rows)}


def _inkling_patches(config, rows: int, size: int, generator) -> dict:
    """Inkling's image: one placeholder per patch of two frames, channels last, every row's in one sequence:
    `pixel_values` (rows x placeholders, 2, patch, patch, channels). Each row's image is the same size, so
    `inputs.share` cuts it at images."""
    import torch

    vision = config.vision_config
    count = placeholders(config)
    return {"pixel_values": torch.randn(rows * count, vision.temporal_patch_size, vision.patch_size,
                                        vision.patch_size, vision.num_channels, generator=generator)}


def _merged_pixels(config, rows: int, size: int, generator) -> dict:
    """Inkling2's pixels, channels last, one block of merge x merge patches per placeholder, every row's in one
    sequence: `pixel_values` (rows x placeholders, merge x patch, merge x patch, channels) and `image_grid_thw`
    (rows, 3) counted in placeholders. Each row's image is the same size, so `inputs.share` cuts it at images."""
    import torch

    merge, patch = config.vision_config.spatial_merge_size, _patch(config)
    side = size // (merge * patch)
    return {"pixel_values": torch.randn(rows * side * side, merge * patch, merge * patch, CHANNELS,
                                        generator=generator),
            "image_grid_thw": torch.tensor([[1, side, side]] * rows)}


def _merged_patches(config, rows: int, size: int, generator) -> dict:
    """Qwen-VL's patches and the merge each image is given: `image_merge_sizes` (rows,), 2 as the builder's
    `merge` (VideoLLaMA3 takes the merge per image, not from its config)."""
    import torch

    return dict(_patches(config, rows, size, generator), image_merge_sizes=torch.tensor([2] * rows))


def _masked_tiles(config, rows: int, size: int, generator) -> dict:
    """One tile per row (rows, 1, channels, size, size) and `pixel_attention_mask` (rows, 1) marking it real:
    Granite Docling encodes only the tiles the mask marks."""
    import torch

    return {"pixel_values": torch.randn(rows, 1, CHANNELS, size, size, generator=generator),
            "pixel_attention_mask": torch.ones(rows, 1, dtype=torch.bool)}


def _naflex(config, rows: int, size: int, generator) -> dict:
    """A SigLIP2 (NaFlex) tower's flattened patches: `pixel_values` (rows, patches, channels x patch x patch),
    `spatial_shapes` (rows, 2) the patch grid, and `pixel_attention_mask` (rows, patches), all patches real."""
    import torch

    patch, grid = _patch(config), size // _patch(config)
    return {"pixel_values": torch.randn(rows, grid * grid, CHANNELS * patch * patch, generator=generator),
            "spatial_shapes": torch.tensor([[grid, grid]] * rows),
            "pixel_attention_mask": torch.ones(rows, grid * grid, dtype=torch.long)}


def _strips(config, rows: int, size: int, generator) -> dict:
    """MiniCPM-V's image as its processor lays one out, a strip of patches side by side: `pixel_values` (rows,
    channels, patch, patches x patch), one image a row, and `target_sizes` (rows, 2) its patch grid. Its processor
    puts a batch's every image in one strip (1, channels, patch, all patches x patch), which `_one_strip` makes of
    these at the model's door."""
    import torch

    patch, grid = _patch(config), size // _patch(config)
    return {"pixel_values": torch.randn(rows, CHANNELS, patch, grid * grid * patch, generator=generator),
            "target_sizes": torch.tensor([[grid, grid]] * rows)}


def _one_strip(kwargs: dict) -> dict:
    """MiniCPM-V's forward encodes `pixel_values[:1]` (minicpmv4_6 modeling_minicpmv4_6.py:707-708, minicpmv4_7
    :714-715, minicpm_ocr :707-708): its processor packs every image of a batch along the last dim of one row,
    cut again by `target_sizes` (the patch embedding's strided convolution reads the strip patch by patch). The
    kit's images, one a row (`_strips`, so that a data-parallel share holds its rows' images), are laid end to end
    into that one strip; a batch already packed (one row for several images) or of one image is left as it is."""
    import torch

    pixels, sizes = kwargs.get("pixel_values"), kwargs.get("target_sizes")
    if pixels is None or sizes is None or pixels.dim() != 4 or not pixels.shape[0] == sizes.shape[0] > 1:
        return kwargs
    return dict(kwargs, pixel_values=torch.cat(list(pixels), dim=-1).unsqueeze(0))


def _minicpm(config) -> None:
    """MiniCPM-V's tower merges 2 x 2 patches after its layer `insert_layer_id` (the ViT merger), and the model
    halves the patch grid for that merge whether the layer exists or not: the default 6 is past the tiny tower's 2
    layers, so the merger runs after layer 0 (on the config and on the vision config, which copies it at init)."""
    config.insert_layer_id = config.vision_config.insert_layer_id = 0


def _qwen_vl(config) -> None:
    """M-RoPE's sections (temporal, height, width) cover the fitted text's rotary half-width, as the real ones
    cover a 128-wide head's 64 (in each layer type's parameters where they are given per layer type); the
    merger's output is the fitted text width. A text config with no `rope_parameters` has no M-RoPE to size."""
    text = text_config(config)
    config.vision_config.out_hidden_size = text.hidden_size
    if not hasattr(text, "rope_parameters"):
        return
    rope = dict(text.rope_parameters or {})
    types = set(getattr(text, "layer_types", None) or ())
    if rope and types.issuperset(rope):  # per layer type: {type: parameters or None}
        text.rope_parameters = {k: v if v is None else _mrope(text, dict(v)) for k, v in rope.items()}
    else:
        text.rope_parameters = _mrope(text, rope)


def _hunyuan_vl(config) -> None:
    """HunYuan-VL's M-RoPE (Qwen-VL's sections: width, height and the image's ordinal as its three axes), and its
    patch merger's output the fitted text width (`text_hidden_size`, which the tiny rule does not know)."""
    _qwen_vl(config)
    config.vision_config.text_hidden_size = text_config(config).hidden_size


def _begin_end_rows(config, side: int) -> int:
    """HunYuan-VL's image: a begin and an end feature around its `side` rows, each row ending with a newline."""
    return side + 2


def _ernie(config) -> None:
    """Ernie 4.5 VL's M-RoPE stacks its height and width sections pairwise, so they must be equal: of the fitted
    rotary half-width, equal height and width sections and the rest temporal, as its real [22, 22, 20]."""
    _qwen_vl(config)
    text = text_config(config)
    half = sum(text.rope_parameters["mrope_section"])
    side = (half - half // 4) // 2
    text.rope_parameters = dict(text.rope_parameters, mrope_section=[side, side, half - 2 * side])


def _mrope(text, rope: dict) -> dict:
    """`rope` with sections of the fitted head's rotary half-width: a quarter each for height and width."""
    rotary = rope.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", None) or 1.0)
    half = int((getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads) * rotary) // 2
    # Read with a default of a 128-wide head's sections where the config names none.
    return dict(rope, mrope_section=[half - 2 * (half // 4), half // 4, half // 4])


def _ovis2(config) -> None:
    """Ovis2's visual embedding table maps each feature to `hidden_size`, which must be the (fitted) text width;
    its tower merges `hidden_stride` patches a side, 2 as in the real tower (the tiny rule leaves 1)."""
    config.hidden_size = text_config(config).hidden_size
    config.vision_config.hidden_stride = 2


def _ovis2_5(config) -> None:
    """Ovis2.5's Qwen-VL-like tower (its text, Qwen3, has no M-RoPE) maps each merged patch to a distribution over
    its own visual vocabulary, then a table maps that to the text: a vocabulary of 64 and its 4 boundary indicators
    (the real one's 65536 rows, which the tiny rule leaves, would be most of the tiny model), the table's width the
    (fitted) text width."""
    config.vision_config.vocab_size = 64 + config.vision_config.num_visual_indicator_tokens
    config.hidden_size = text_config(config).hidden_size


def _unlimited_ocr(config) -> None:
    """Unlimited-OCR's CLIP encoder embeds the SAM encoder's output as its patches, so the SAM neck's channels
    (`output_channels`, `downsample_channels`, which the tiny rule does not know) are the CLIP width; SAM draws
    its weights with a standard deviation of 1e-10 (as GotOcr2's), which would keep the image from the text: 0.02."""
    sam, clip = config.vision_config.sam_config, config.vision_config.encoder_config
    sam.output_channels, sam.downsample_channels = clip.hidden_size, [clip.hidden_size, clip.hidden_size]
    sam.mlp_dim, sam.initializer_range = 2 * sam.hidden_size, 0.02


def _row_ends_and_separator(config, side: int) -> int:
    """A newline feature ending each of the image's `side` rows, then the view separator."""
    return side + 1


def _step3p7(config) -> None:
    """Step3p7's text model builds a sliding-window mask whatever its layer types (its defaults' are all full
    attention), which raises where the config names no window (its default None): one longer than any row here."""
    text = text_config(config)
    text.sliding_window = text.sliding_window or 4096


def _muse(config) -> None:
    """Muse's adapter reads the tower's merged output (`out_hidden_size`: the tower's width over 2 x 2 patches) and
    keeps its own width (`projector_hidden_size`), which the tiny rule does not know: the fitted text width."""
    vision = config.vision_config
    config.out_hidden_size = vision.hidden_size * vision.merge_size ** 2
    config.projector_hidden_size = text_config(config).hidden_size


def _muse_spark(config) -> None:
    """Muse Spark: Muse's adapter, and an audio tower it always builds (it runs no audio here, but its sizes must
    build): one block per stage of 16 channels, where the tiny rule leaves the real stages' 256 to 2048 (100M
    parameters)."""
    _muse(config)
    audio = config.audio_config
    audio.hidden_sizes, audio.depths = [16] * len(audio.hidden_sizes), [1] * len(audio.depths)


def _nemotron_h_omni(config) -> None:
    """Nemotron-H Omni's projector reads the RADIO tower's pixel-shuffled features (`vision_hidden_size`, the real
    tower's 1280) and keeps its own width (`projector_hidden_size`), which the tiny rule does not know: the tower's
    fitted width, and the fitted text width."""
    config.vision_hidden_size = config.vision_config.hidden_size
    config.projector_hidden_size = text_config(config).hidden_size


def _inkling(config) -> None:
    """Inkling's tower folds a whole patch (2 frames x patch x patch x channels) into depth, layer by layer, so its
    widths follow the patch, not `hidden_size`: the real 40-pixel patch makes layers 614,400 wide. A 4-pixel patch
    over 4 layers (96 values a patch), its output the fitted text width (`text_hidden_size`)."""
    vision = config.vision_config
    vision.patch_size, vision.num_hidden_layers = 4, 4
    vision.text_hidden_size = text_config(config).hidden_size


def _omni_thinker(config) -> None:
    """A Qwen Omni thinker: Qwen-VL's tower and M-RoPE, and an audio tower it always builds (it runs no audio here,
    but its sizes must build): 2 layers of 2 heads over the fitted width, its output the fitted text width. The
    tiny rule leaves the real 20 heads (no divisor of the fitted width) and 32 layers of 5120-wide MLPs."""
    _qwen_vl(config)
    audio = config.audio_config
    audio.encoder_layers, audio.encoder_attention_heads, audio.encoder_ffn_dim = 2, 2, 2 * audio.d_model
    audio.output_dim = text_config(config).hidden_size
    if hasattr(audio, "downsample_hidden_size"):  # Qwen3 Omni's convolutional front end
        audio.downsample_hidden_size = audio.d_model


def _qwen2_vl(config) -> None:
    """Qwen2-VL's tower keeps its own sizes (`embed_dim`, `depth`), which the tiny rule does not know: 2 blocks of
    32, and an output (`hidden_size`) of the fitted text width."""
    _qwen_vl(config)
    vision = config.vision_config
    vision.embed_dim, vision.depth, vision.num_heads = 32, 2, 2
    vision.hidden_size = text_config(config).hidden_size


def _llama4(config) -> None:
    """Llama 4's pixel-shuffle MLP and projector keep their own widths, which the tiny rule does not know: the
    tower's width after the shuffle (which its MLP's `intermediate_size` also is, as in the real tower), then the
    tower's width."""
    vision = config.vision_config
    vision.intermediate_size = int(vision.hidden_size / vision.pixel_shuffle_ratio ** 2)
    vision.projector_input_dim = vision.projector_output_dim = vision.vision_output_dim = vision.hidden_size


def _got_ocr2(config) -> None:
    """GotOcr2's vision config draws its weights with a standard deviation of 1e-10 (SAM's default), so a tiny
    model's image would not reach the text (its logits do not change with the pixels): 0.02, as its text's."""
    config.vision_config.initializer_range = 0.02


def _idefics2(config) -> None:
    """Idefics2's perceiver resamples each image to `resampler_n_latents` features, its placeholder count."""
    config.perceiver_config.resampler_n_latents = SIDE * SIDE


def _anyres(config) -> None:
    """One grid cell: the image is its own best fit, so the tiles are the resized base image and one crop."""
    size = config.vision_config.image_size
    config.image_grid_pinpoints = [[size, size]]


def _cls_kept(config, side: int) -> int:
    """A CLIP tower's class token, kept under the "full" feature strategy (dropped under "default")."""
    return int(getattr(config, "vision_feature_select_strategy", "default") == "full"
               and config.vision_config.model_type == "clip_vision_model")


def _row_ends(config, side: int) -> int:
    """A newline feature ending each of the image's `side` rows of placeholders."""
    return side


def _newlines(config, side: int) -> int:
    """llava_next's anyres: the base image's `side * side` features, then the crop's, each of its `side` rows
    ending with a newline feature."""
    return side + side * side


#: Qwen-VL's patches, 2 x 2 merged into a placeholder; M-RoPE reads where the image is from `mm_token_type_ids`.
_QWEN_VL = Builder(merge=2, configure=_qwen_vl, pixels=_patches, token_types=("mm_token_type_ids", "image"))
#: The same for a family whose forward takes no `mm_token_type_ids` (its positions come from the grid alone).
_QWEN_VL_UNTYPED = Builder(merge=2, configure=_qwen_vl, pixels=_patches)

#: model type -> how the kit shapes its image.
BUILDERS = {
    "llava": Builder(more=_cls_kept),
    "vipllava": Builder(configure=_vipllava),
    # 0 on the prefix (the image), which attends both ways.
    "paligemma": Builder(configure=_paligemma, token_types=("token_type_ids", "text")),
    # The image's tokens attend both ways.
    "gemma3": Builder(merge=2, configure=_gemma3, token_types=("token_type_ids", "image")),
    "mistral3": Builder(merge=2, configure=_pixtral, sizes=True),
    "aya_vision": Builder(merge=2),
    "cohere2_vision": Builder(merge=2),
    "internvl": Builder(merge=2),
    "idefics3": Builder(merge=2, tiles=1),
    "smolvlm": Builder(merge=2, tiles=1),
    # The base image and one crop, each of one patch (with a class token dropped): 3 placeholders.
    "llava_next": Builder(side=1, more=_newlines, configure=_anyres, tiles=2, sizes=True),
    "llava_onevision": Builder(side=1, more=_newlines, configure=_anyres, tiles=2, sizes=True),
    "qwen2_vl": Builder(merge=2, configure=_qwen2_vl, pixels=_patches, token_types=("mm_token_type_ids", "image")),
    "qwen2_5_vl": _QWEN_VL,
    "llama4": Builder(merge=2, configure=_llama4),
    "qwen3_vl": _QWEN_VL,
    "qwen3_vl_moe": _QWEN_VL,
    "qwen3_5": _QWEN_VL,
    "qwen3_5_moe": _QWEN_VL,
    "glm4v": _QWEN_VL,
    "glm4v_moe": _QWEN_VL,
    "lighton_ocr": Builder(merge=2, configure=_pixtral, sizes=True),
    "llava_next_video": Builder(side=1, more=_newlines, configure=_anyres, tiles=2, sizes=True),
    "got_ocr2": Builder(merge=4, configure=_got_ocr2),  # its neck convolves the patches down 4 a side
    "video_llava": Builder(more=_cls_kept),
    "idefics2": Builder(configure=_idefics2, tiles=1),
    "glm46v": _QWEN_VL,
    "glm_ocr": _QWEN_VL,
    "deepseek_vl": Builder(),
    "ovis2": Builder(merge=2, configure=_ovis2),
    "llava_onevision1_5": _QWEN_VL,
    "lfm2_vl": Builder(merge=2, pixels=_naflex),
    "janus": Builder(configure=_janus),  # its projector unshuffles 2 x 2 patches into one placeholder
    "glmga": _QWEN_VL,  # Glm46V's classes under a second model type
    "pp_chart2table": Builder(merge=4, configure=_got_ocr2),  # GotOcr2's classes
    "qianfan_ocr": Builder(merge=2),
    "cosmos3_omni": _QWEN_VL,
    "cosmos3_edge": Builder(merge=2, configure=_qwen_vl, pixels=_packed, token_types=("mm_token_type_ids", "image")),
    "exaone4_5": _QWEN_VL_UNTYPED,
    "hyperclovax_vision_v2": _QWEN_VL_UNTYPED,
    "minimax_m3_vl": _QWEN_VL_UNTYPED,
    "glm5_next": _QWEN_VL,  # its text config has no rope_parameters: no M-RoPE to size
    "mistral_large4": Builder(merge=2, configure=_pixtral, sizes=True),
    "granite_docling": Builder(merge=4, pixels=_masked_tiles),  # its pixel shuffle merges 4 x 4 patches
    "lfm3_vl": Builder(merge=2, configure=_qwen_vl, pixels=_packed),
    # One merged placeholder and its row's end: 2 placeholders, which fit the generate prompts' padded rows.
    "hy_v4_vl": Builder(merge=2, side=1, more=_row_ends, configure=_qwen_vl, pixels=_packed,
                        token_types=("mm_token_type_ids", "image")),
    "video_llama_3": Builder(merge=2, configure=_qwen_vl, pixels=_merged_patches),
    "paddleocr_vl": Builder(merge=2, configure=_qwen_vl, pixels=_packed_images,
                            token_types=("mm_token_type_ids", "image")),
    # One merged placeholder, its row's end, the image's begin and end: 4 placeholders. Its M-RoPE counts images
    # over the whole batch, not per row: declared upstream (docs/upstream/transformers_hunyuan_vl_batch_image_index.md).
    "hunyuan_vl": Builder(merge=2, side=1, more=_begin_end_rows, configure=_hunyuan_vl, pixels=_packed,
                          token_types=("mm_token_type_ids", "image")),
    "ernie4_5_vl_moe": Builder(merge=2, configure=_ernie, pixels=_packed, token_types=("mm_token_type_ids", "image")),
    "inkling2": Builder(merge=2, pixels=_merged_pixels),
    "inkling2_loop": Builder(merge=2, pixels=_merged_pixels),
    # Ovis2.5's image begin and end indicators get learned features of their own; its forward takes no token types.
    # One merged placeholder between them (3 tokens, which fit the generate prompts' padded rows).
    "ovis2_5": Builder(merge=2, side=1, configure=_ovis2_5, pixels=_packed,
                       bounds=("image_start_token_id", "image_end_token_id")),
    # M-RoPE finds each image from the vision-start token before it (the thinker's config names none: 151652 in
    # the full Omni config), and takes no token types. One merged placeholder between the vision start and end
    # (3 tokens, which fit the generate prompts' padded rows).
    "qwen2_5_omni_thinker": Builder(merge=2, side=1, configure=_omni_thinker, pixels=_patches,
                                    bounds=("vision_start_token_id", "vision_end_token_id")),
    "qwen3_omni_moe_thinker": Builder(merge=2, side=1, configure=_omni_thinker, pixels=_patches,
                                      bounds=("vision_start_token_id", "vision_end_token_id")),
    "muse_glimmer": Builder(merge=2, configure=_muse, pixels=_packed),
    "muse_spark": Builder(merge=2, configure=_muse_spark, pixels=_packed),
    "inkling_mm_model": Builder(configure=_inkling, pixels=_inkling_patches),
    # Its projector pixel-shuffles 2 x 2 patches into one placeholder.
    "nemotron_h_omni": Builder(merge=2, configure=_nemotron_h_omni, pixels=_packed_hw),
    "step3p7": Builder(merge=4, configure=_step3p7),  # its projector convolves the patches down 4 a side
    # Its SAM encoder's neck convolves the patches down 4 a side: one placeholder, its row's end and the view
    # separator (3, which fit the generate prompts' padded rows).
    "unlimited_ocr": Builder(merge=4, side=1, more=_row_ends_and_separator, configure=_unlimited_ocr,
                             tower=lambda config: config.vision_config.sam_config),
    # Its ViT merger then its projector merge 2 x 2 patches each: 4 x 4 patches a placeholder.
    "minicpmv4_6": Builder(merge=4, configure=_minicpm, pixels=_strips, door=_one_strip),
    # Its default `downsample_mode` "4x" skips the ViT merger: 2 x 2 patches a placeholder.
    "minicpm_ocr": Builder(merge=2, pixels=_strips, door=_one_strip),
    "minicpmv4_7": Builder(merge=4, configure=_minicpm, pixels=_strips, door=_one_strip,
                           token_types=("mm_token_type_ids", "image")),
}

_TIMM = "its vision tower is a timm model (TimmWrapperConfig), and timm is not installed here"
_UNBUILT = "its config class's own defaults do not build its model"

#: model type -> why the kit makes no image inputs for it (a family its inputs cannot serve).
REFUSED = {
    "aria": "its projector holds queries only for its real images' patch counts (35 or 70 a side), so no tiny image",
    "deepseek_vl_hybrid": "each image is also a second, high-resolution tensor (high_res_pixel_values) of its own "
                          "tower",
    "kimi_k25": "its projector's layer norm keeps the real tower's width (1152), which the tiny rule does not reach",
    # (1, channels, patch, patches x patch), of which the forward encodes `pixel_values[:1]`: every image in one row.
    # modeling_deepseek_ocr2.py:938-939 (two query tables of fixed size, not a config's), :949-959 (the queries
    # alone come out), :1429-1437 (the separator); the kit's rows: `fixtures.SPACE` (12 tokens, 64 at most).
    "deepseek_ocr2": "its vision tower appends a learned query table of fixed size, 144 entries (256 above 144 "
                     "patches), to every image's patches and keeps only the queries' outputs, and a view separator "
                     "follows: every image is 145 placeholders whatever its size, more than any of the kit's token "
                     "rows hold (12 tokens, 64 at most)",
    "emu3": "its images are a VQ tokenizer's codes in the text, not a vision tower's features",
    "fast_vlm": _TIMM,
    "perception_lm": _TIMM,
    "gemma3n": "its vision tower is a timm MobileNetV5 (mobilenetv5_300m_enc), whose config has no patch size: "
               "an image size for it is not the kit's patch rule",
    "cohere_compass": _UNBUILT + " (its rotary reads rope_parameters per layer type, which the defaults leave empty)",
    "qwen4_exp": _UNBUILT + " (its indexer divides indexer_budget by indexer_compress_ratio, both None)",
    "granite4_vision": _UNBUILT + " (deepstack_layer_map None)",
    "diffusion_gemma": _UNBUILT + " (its router's num_experts None)",
    "mistral4": "the mapping gives it Mistral4ForCausalLM, a text-only class: no vision tower, no image to make",
    "t5gemma2": "an encoder-decoder whose images enter through its encoder, which the image-text task's decoder-only "
                "inputs do not reach; its text runs as the seq2seq family t5gemma2-seq2seq",
    "gemma4": "its config's defaults name no vision tower (vision_config None), so there is no image to make",
    "gemma4_unified": "its config's defaults name no vision tower (vision_config None), so there is no image to make",
    "shieldgemma2": "the mapping builds Gemma3ForConditionalGeneration from ShieldGemma2Config, whose checkpoint "
                    "conversion writes every weight under a second prefix (model.model.language_model.model.*) that "
                    "from_pretrained does not read back: even one process reloads it at random",
}


def text_config(config):
    return getattr(config, "text_config", None) or config


def builder(config) -> Builder:
    """The family's builder; `refused.NoBuilder` names a family the kit makes no image inputs for."""
    return lookup(BUILDERS, REFUSED, config, "image", "an image")


def prepared(config):
    """A copy of `config` whose image is square (`Builder.merge * SIDE` patches a side), whose placeholder token is
    the last of the text vocabulary (a token the random text never draws) and whose image sequence length matches."""
    build = builder(config)
    config = copy.deepcopy(config)
    _vision_size(config, _patch(config) * build.merge * build.side)
    build.configure(config)
    config.image_token_id = text_config(config).vocab_size - 1
    for offset, name in enumerate(build.bounds, start=2):
        if name:
            setattr(config, name, text_config(config).vocab_size - offset)
    config.image_seq_length = build.side * build.side + build.more(config, build.side)
    return config


def doored(model):
    """`model` with its family's door (`Builder.door`) where its family has one, at both ways in: a forward
    pre-hook (the kit's calls, the Trainer's) and `generate` (which encodes the images before any forward, through
    `get_image_features`: transformers' `_prepare_multimodal_encoder_kwargs_for_generation`), so every call takes
    the batch as the family's processor would have packed it."""
    import functools

    build = BUILDERS.get(getattr(model.config, "model_type", None))
    if build is None or build.door is None:
        return model
    model.register_forward_pre_hook(lambda module, args, kwargs: (args, build.door(kwargs)), with_kwargs=True)
    generate = model.generate
    model.generate = functools.wraps(generate)(lambda *args, **kwargs: generate(*args, **build.door(kwargs)))
    return model


def placeholders(config) -> int:
    return config.image_seq_length


def image_size(config) -> int:
    size = builder(config).tower(config).image_size
    return size[0] if isinstance(size, (list, tuple)) else size


def pixels(config, rows: int, seed: int) -> dict:
    """The per-row image tensors of `rows` rows: `pixel_values`, and `image_sizes` where the family takes them."""
    import torch

    build, size = builder(config), image_size(config)
    tiles = (build.tiles,) if build.tiles else ()
    generator = torch.Generator().manual_seed(seed + 2)
    if build.pixels:
        return build.pixels(config, rows, size, generator)
    out = {"pixel_values": torch.randn(rows, *tiles, CHANNELS, size, size, generator=generator)}
    if build.sizes:
        out["image_sizes"] = torch.tensor([[size, size]] * rows)
    return out


def _bound_ids(config) -> list:
    """The ids of the family's tokens before and after an image (`Builder.bounds`), None where it writes none."""
    return [getattr(config, name) if name else None for name in builder(config).bounds]


def with_images(batch: dict, config, seed: int) -> dict:
    """`batch` with one image per row: `placeholders(config)` placeholder tokens from each row's first unmasked
    position (after the family's token before an image, and followed by its token after one, where it names them;
    at least one text token left after them), the image tensors (`pixels`), `token_type_ids` where the family's
    processor gives them, and labels -100 on the placeholders (a vision-language loss predicts text only).
    Rows too short for an image raise ValueError."""
    ids, image = inputs.placed(batch, config.image_token_id, placeholders(config), "an image", *_bound_ids(config))
    out = dict(batch, input_ids=ids, **pixels(config, ids.shape[0], seed))
    types = builder(config).token_types
    if types:
        key, on = types
        out[key] = (image if on == "image" else ~image).long()
    if "labels" in batch:
        out["labels"] = ids.masked_fill((batch["labels"] == -100) | image, -100)
    return out
