"""Full-size model specs for `paracheck topology --simulate --spec paracheck.adapters.diffusers.simulate.specs:NAME`.

Each returns `(model_class, init_dict, inputs)` like any spec. The configurations are the released
models' (the class defaults where those are the release), which only a simulation can afford: the model is
built on the meta device, so no weights exist. The inputs are meta tensors of a realistic size (a
1024x1024 image for Flux; a short packed video+audio+text sequence for MiniMax-H3) whose sequence lengths
every context-parallel degree up to 128 divides; they are only used by `--collectives`.
"""

from __future__ import annotations

import torch


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, device="meta", dtype=dtype)


def flux_dev():
    """FLUX.1-dev: 19 double + 38 single blocks, 24 heads of 128, guidance embedding."""
    from diffusers import FluxTransformer2DModel

    init = dict(guidance_embeds=True)  # the class defaults are FLUX.1's; dev adds the guidance embedder
    image, text = 4096, 512  # 1024x1024 -> 64x64 latent patches; T5 at 512 tokens
    inputs = dict(
        hidden_states=_meta(1, image, 64),
        encoder_hidden_states=_meta(1, text, 4096),
        pooled_projections=_meta(1, 768),
        timestep=_meta(1),
        guidance=_meta(1),
        img_ids=_meta(image, 3),
        txt_ids=_meta(text, 3),
    )
    return FluxTransformer2DModel, init, inputs


def minimax_h3():
    """MiniMax-H3 at its released size: 56 heads of 128, 50 blocks (the class defaults). No `_tp_plan`."""
    from diffusers import MiniMaxH3Transformer3DModel

    video, audio, text = 3072, 512, 512  # packed sequence of 4096 rows
    seq = video + audio + text
    long = torch.long
    inputs = dict(
        hidden_states=_meta(1, video, 24 * 4),
        audio_hidden_states=_meta(1, audio, 32),
        encoder_hidden_states=_meta(1, text, 5120),
        timestep=_meta(2),
        timestep_indices=_meta(seq, dtype=long),
        token_tags=_meta(seq, dtype=long),
        position_ids=_meta(seq, 3, dtype=long),
        video_indices=_meta(video, dtype=long),
        audio_indices=_meta(audio, dtype=long),
        text_indices=_meta(text, dtype=long),
    )
    return MiniMaxH3Transformer3DModel, {}, inputs
