"""A speech or audio model's inputs, made with no download: the tiny audio encoder and clip length a config is
given, the placeholder tokens each row carries for its clip, and the mel features (and masks) its forward takes.

These are the seq2seq mapping's classes that are no encoder-decoder: an audio encoder in front of a causal LM,
whose audio features replace placeholder tokens in the text (the task `tasks.AUDIO_TEXT`). What a processor makes
of a clip is family-specific (the encoder's expected frame count, how many frames become one placeholder, which
mask tensor the forward takes), so each family the kit runs has a `Builder` in `BUILDERS`; a family known not to
fit the kit's inputs is in `REFUSED` with its reason; any other is refused before launch with `NoBuilder`. Every
tensor a builder adds has one entry per row (dim 0), so `inputs.share` splits it over data-parallel ranks as it
splits the token rows.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

from paracheck.adapters.transformers import inputs
from paracheck.adapters.transformers.refused import lookup

#: Placeholders per clip: few enough to leave text in the padded rows (`inputs.PAD` tokens padded of 16).
TOKENS = 4
#: A tiny audio encoder's sizes where the tiny rule does not reach them (Whisper's key names, a conformer's):
#: 2 layers, 2 heads of 16, widths 32, as `fitting.tiny` shrinks a text config.
LAYERS, HEADS, HEAD_DIM, WIDTH = 2, 2, 16, 32


@dataclass(frozen=True)
class Builder:
    """One family's clip, as its feature extractor and processor would shape it."""
    #: (config) -> None: the tiny encoder's sizes and clip length (its frames make `TOKENS` placeholders).
    configure: Callable
    #: (config) -> mel frames per clip (waveform samples where `FEATURES` makes a raw clip).
    frames: Callable
    #: The forward's mask over mel frames (1 on real frames), or None where it takes none.
    mask: str | None = "input_features_mask"
    #: (config, rows, frames) -> the forward's other per-row tensors (a raw clip's padding mask).
    extra: Callable = lambda config, rows, frames: {}
    #: (config) -> the real frames of a clip padded to `frames` (the mask's 1s), or None: all of them.
    real: Callable | None = None
    #: (config) -> mel bins per frame.
    bins: Callable = lambda config: audio_config(config).num_mel_bins
    #: `input_features` as (rows, frames, bins) and a boolean mask (NeMo's layout), not (rows, bins, frames).
    nemo: bool = False


def audio_config(config):
    return config.audio_config


def _whisper_sizes(audio) -> None:
    """A Whisper-style encoder (its own key names, which the tiny rule does not read) at the tiny sizes."""
    audio.encoder_layers, audio.encoder_attention_heads = LAYERS, HEADS
    audio.d_model, audio.encoder_ffn_dim = HEADS * HEAD_DIM, WIDTH


def _whisper(config) -> None:
    """A Whisper encoder: two convolutions (the second of stride 2) then an average pool of 2, so its expected
    `2 x max_source_positions` frames make `max_source_positions / 2` placeholders."""
    audio = audio_config(config)
    _whisper_sizes(audio)
    audio.max_source_positions = 2 * TOKENS


def _whisper_frames(config) -> int:
    return 2 * audio_config(config).max_source_positions


def _voxtral(config) -> None:
    """Voxtral's encoder stacks 4 frames into one `intermediate_size` vector (4 x its width, as the real 1280 and
    5120) before its projector, and pools none: `2 x max_source_positions` frames make `max_source_positions / 4`."""
    audio = audio_config(config)
    audio.hidden_size, audio.num_attention_heads = HEADS * HEAD_DIM, HEADS
    audio.intermediate_size = 4 * audio.hidden_size
    audio.max_source_positions = 4 * TOKENS


def _glmasr(config) -> None:
    """GLM-ASR's encoder halves the frames (its second convolution's stride) and stacks 4 into one
    `intermediate_size` vector (4 x its width, as the real 1280 and 5120): 8 frames per placeholder."""
    audio = audio_config(config)
    audio.intermediate_size = 4 * audio.hidden_size


def _glmasr_frames(config) -> int:
    return 8 * TOKENS


def _granite(config) -> None:
    """Granite Speech's conformer (its own key names, which the tiny rule does not read) at the tiny sizes, and its
    Q-Former projector reading that width; the projector turns each window of `window_size` frames into
    `window_size / downsample_rate` queries: one window of `TOKENS` queries."""
    encoder = config.encoder_config
    encoder.num_layers, encoder.num_heads, encoder.dim_head = LAYERS, HEADS, HEAD_DIM
    encoder.hidden_dim = HEADS * HEAD_DIM
    encoder.input_dim = 2 * 16  # two stacked frames of 16 mel bins (the real 2 x 80)
    config.projector_config.encoder_hidden_size = encoder.hidden_dim
    config.downsample_rate, config.window_size = 2, 2 * TOKENS
    config.has_lora_adapter = False  # the real checkpoints' speech LoRA needs peft, not installed here


def _granite_frames(config) -> int:
    return config.window_size


def _moss(config) -> None:
    """MOSS's Whisper encoder halves its expected `2 x max_source_positions` frames (its second convolution's
    stride) and stacks `audio_merge_size` of them into a placeholder (4, as the real)."""
    audio = audio_config(config)
    audio.max_source_positions = config.audio_merge_size * TOKENS


def _moss_padding(config, rows: int, frames: int) -> dict:
    """`padding_mask` (rows, samples): each row's raw clip, one Whisper chunk (under `audio_chunk_size` samples),
    all real: MOSS maps its feature rows to clips by it. 160 samples per mel frame (the real hop)."""
    import torch

    return {"padding_mask": torch.ones(rows, 160 * frames, dtype=torch.long)}


def _qwen3_asr(config) -> None:
    """Qwen3-ASR's encoder (Whisper's key names, which the tiny rule does not read) at the tiny sizes, its projector's
    output the (fitted) text width. It cuts a clip into windows of `2 x n_window` frames (kept at the real 50: its
    length rule counts a whole window as 13 placeholders, the real window's), each convolved down 8 times (three
    convolutions of stride 2): one window padded to 100 frames of which `8 x TOKENS` are real (`_qwen3_asr_real`)."""
    audio = audio_config(config)
    _whisper_sizes(audio)
    audio.downsample_hidden_size = WIDTH // 2
    audio.output_dim = config.get_text_config().hidden_size


def _qwen3_asr_frames(config) -> int:
    return 2 * audio_config(config).n_window


def _qwen3_asr_real(config) -> int:
    return 8 * TOKENS


def _omniasr(config) -> None:
    """OmniASR's wav2vec2 encoder reads the raw waveform through seven convolutions (a stride of 320 in all), whose
    512 channels and 128-wide positional convolution the tiny rule does not reach: 32 channels, a kernel of 4."""
    audio = audio_config(config)
    audio.conv_dim = [WIDTH] * len(audio.conv_dim)
    audio.num_conv_pos_embeddings, audio.num_conv_pos_embedding_groups = 4, 2


def _omniasr_samples(config) -> int:
    """The fewest waveform samples the convolutions turn into `TOKENS` frames (each takes `(n - kernel) // stride
    + 1`), inverted layer by layer from the last."""
    audio, length = audio_config(config), TOKENS
    for kernel, stride in reversed(list(zip(audio.conv_kernel, audio.conv_stride))):
        length = (length - 1) * stride + kernel
    return length


def _omniasr_features(config, rows: int, generator) -> dict:
    """`input_values` (rows, 1, samples): each row's raw waveform, and `padding_mask` (rows, samples), all real."""
    import torch

    samples = _omniasr_samples(config)
    return {"input_values": torch.randn(rows, 1, samples, generator=generator),
            "padding_mask": torch.ones(rows, samples, dtype=torch.long)}


def _granite_features(config, rows: int, generator) -> dict:
    import torch

    frames, bins = _granite_frames(config), config.encoder_config.input_dim
    return {"input_features": torch.randn(rows, frames, bins, generator=generator)}


def _fun_asr(config) -> None:
    """Fun-ASR-Nano's SAN-M encoder keeps every (already frame-stacked) feature: `TOKENS` frames make `TOKENS`
    placeholders. Its 20 timestamp-prediction layers are cut to one of the tiny encoder's."""
    config.audio_config.num_timestamp_prediction_layers = 1


#: model type -> how the kit shapes its clip.
BUILDERS = {
    "qwen2_audio": Builder(_whisper, _whisper_frames, mask="feature_attention_mask"),
    "voxtral": Builder(_voxtral, _whisper_frames, mask=None),
    "audioflamingo3": Builder(_whisper, _whisper_frames),
    "glmasr": Builder(_glmasr, _glmasr_frames),
    "granite_speech": Builder(_granite, _granite_frames, mask=None),
    "granite_speech_plus": Builder(_granite, _granite_frames, mask=None),
    "musicflamingo": Builder(_whisper, _whisper_frames),
    "moss_transcribe_diarize": Builder(_moss, _whisper_frames, extra=_moss_padding),
    "qwen3_asr": Builder(_qwen3_asr, _qwen3_asr_frames, real=_qwen3_asr_real),
    "omniasr": Builder(_omniasr, _omniasr_samples, mask=None),
    # Its FastConformer subsamples the frames 8 times (`asr_config.subsampling_factor`). Its NemotronH text model
    # counts its layers by `layers_block_type` alone, which the tiny rule cuts (`fitting._layer_list`).
    "nemo_speechlm": Builder(lambda config: None, lambda config: 8 * TOKENS,
                             bins=lambda config: config.audio_config.asr_config.num_mel_bins, nemo=True),
    # (rows, frames, features) of `num_mel_bins x num_stacked_frames` each (its processor's low-frame-rate stack).
    "fun_asr_nano": Builder(_fun_asr, lambda config: TOKENS, bins=lambda config: config.audio_config.input_size,
                            nemo=True),
}
#: model type -> the clip's tensors where they are not `input_features` (rows, mel bins, frames) and its mask.
FEATURES = {"granite_speech": _granite_features, "granite_speech_plus": _granite_features,
            "omniasr": _omniasr_features}

#: model type -> why the kit makes no audio inputs for it.
REFUSED = {
    "voxtral_realtime": "a streaming model with no placeholders: its encoder's frames are added to every text "
                        "position, the tokens it generates included (each step reads the next frames), which the "
                        "kit's one clip per row before its text does not make",
    "vibevoice_asr": "its forward samples its acoustic tokenizer's latent with fresh noise by default (sample=True, "
                     "a flag the kit's batches of per-row tensors do not carry), so no two processes run the same "
                     "forward",
    "vibevoice": "a text-to-speech model (the speech seq2seq mapping's): its forward samples the voice prompt's "
                 "acoustic latent with fresh noise by default (sample=True, as vibevoice_asr's) and its speech comes "
                 "from a diffusion head the kit does not check",
}


def builder(config) -> Builder:
    """The family's builder; `refused.NoBuilder` names a family the kit makes no audio inputs for."""
    return lookup(BUILDERS, REFUSED, config, "audio", "a clip")


def prepared(config):
    """A copy of `config` with a tiny audio encoder whose clip makes `TOKENS` placeholders, the placeholder token
    the last of the text vocabulary (a token the random text never draws)."""
    build = builder(config)
    config = copy.deepcopy(config)
    build.configure(config)
    config.audio_token_id = config.get_text_config().vocab_size - 1
    return config


def features(config, rows: int, seed: int) -> dict:
    """The per-row clip tensors of `rows` rows: `input_features` (rows, mel bins, frames) of a whole clip each, and
    the mask the family's forward takes (all frames real)."""
    import torch

    generator = torch.Generator().manual_seed(seed + 2)
    if config.model_type in FEATURES:
        return FEATURES[config.model_type](config, rows, generator)
    build = builder(config)
    frames = build.frames(config)
    shape = (rows, frames, build.bins(config)) if build.nemo else (rows, build.bins(config), frames)
    out = {"input_features": torch.randn(*shape, generator=generator)}
    if build.mask:
        real = (torch.arange(frames) < (build.real(config) if build.real else frames)).expand(rows, frames).clone()
        out[build.mask] = real if build.nemo else real.long()
    return dict(out, **build.extra(config, rows, frames))


def with_audio(batch: dict, config, seed: int) -> dict:
    """`batch` with one clip per row: `TOKENS` placeholder tokens from each row's first unmasked position (at least
    one text token left after them), the clip's tensors (`features`), and labels -100 on the placeholders (the
    loss predicts text only). Rows too short for a clip raise ValueError."""
    ids, clip = inputs.placed(batch, config.audio_token_id, TOKENS, "a clip")
    out = dict(batch, input_ids=ids, **features(config, ids.shape[0], seed))
    if "labels" in batch:
        out["labels"] = ids.masked_fill((batch["labels"] == -100) | clip, -100)
    return out
