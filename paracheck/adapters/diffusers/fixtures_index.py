"""The diffusers fixtures: names -> factories, the classes they build, the variants and shapes each takes.

Torch-free, so the CLI can validate `--models` and `--variants` before any rank starts.
"""

FIXTURES: dict[str, str] = {
    "flux": "paracheck.fixtures:flux",
    "flux2": "paracheck.fixtures:flux2",
    "qwenimage": "paracheck.fixtures:qwenimage",
    "wan": "paracheck.fixtures:wan",
    "ltx": "paracheck.fixtures:ltx",
    "qwenimage21": "paracheck.fixtures:qwenimage21",
    "chronoedit": "paracheck.fixtures:chronoedit",
    "helios": "paracheck.fixtures:helios",
    "ltx2": "paracheck.fixtures:ltx2",
    "minimax_h3": "paracheck.fixtures:minimax_h3",
}


#: The diffusers classes the fixtures build (preloaded by the fork server).
FIXTURE_CLASSES = (
    "FluxTransformer2DModel", "Flux2Transformer2DModel", "QwenImageTransformer2DModel", "WanTransformer3DModel",
    "LTXVideoTransformer3DModel", "QwenImage21Transformer2DModel", "ChronoEditTransformer3DModel",
    "HeliosTransformer3DModel", "LTX2VideoTransformer3DModel", "MiniMaxH3Transformer3DModel",
)

#: The parallel plans each fixture's class carries in the diffusers the kit supports ("tp": `_tp_plan`, "cp":
#: `_cp_plan`); a layout needing one it lacks is a skip. Read before any rank starts (the quick tier lets no such
#: skip stand in for a pair it must meet); `tests/domain/test_tier.py` checks it against the classes themselves.
FIXTURE_PLANS: dict[str, tuple[str, ...]] = {
    "flux": ("tp", "cp"), "flux2": ("tp", "cp"), "qwenimage": ("tp", "cp"), "qwenimage21": ("tp",),
    "wan": ("cp",), "ltx": ("cp",), "chronoedit": ("cp",), "helios": ("cp",), "ltx2": ("cp",), "minimax_h3": ("cp",),
}
#: Input variants a fixture factory takes as `variant=` (same model class and init dict, so the same weights):
#: base (the default inputs), batch2 (two samples at different timesteps), masked (batch 2, sample 1's text
#: padded and masked out), uneven (a `_cp_plan`-split length that 2 and 4 ranks do not divide, batch 1).
VARIANTS = ("base", "batch2", "masked", "uneven")

_PLAIN = ("base", "batch2", "uneven")
_MASKED = ("base", "batch2", "masked", "uneven")

#: Which variants each fixture offers. `masked` only where the forward takes a text mask that reaches attention.
#: Flux and Flux2 take none of their own (an `attention_mask` in `joint_attention_kwargs` would reach SDPA, but no
#: pipeline passes one and the `_cp_plan` does not split it); Wan, ChronoEdit and Helios pass `attn_mask=None` to
#: their cross-attention; MiniMax-H3 packs one request into one unmasked attention document.
FIXTURE_VARIANTS: dict[str, tuple[str, ...]] = {
    "flux": _PLAIN,
    "flux2": _PLAIN,
    "qwenimage": _MASKED,
    "wan": _PLAIN,
    "ltx": _MASKED,
    # No `uneven`: QwenImage21 has no `_cp_plan` (TP only), so no length is ever split.
    "qwenimage21": ("base", "batch2", "masked"),
    "chronoedit": _PLAIN,
    "helios": _PLAIN,
    "ltx2": _MASKED,
    # batch2 differs in latents and text only: MiniMax-H3's `timestep` is a table of noise levels addressed per
    # packed row (`timestep_indices`) and shared by every sample, so two samples cannot have different timesteps.
    "minimax_h3": _PLAIN,
}


def _spaces():
    from paracheck.domain.shapes import Axis, Space

    image = dict(image=Axis(16, 15, 1, 24), text=Axis(8, 7, 1, 16))
    grid = dict(height=Axis(4, 3, 1, 6), width=Axis(4, 5, 1, 6))
    # Wan-like video in patches (patch 2x2 over latent pixels); the text is not split.
    video = dict(frames=Axis(2, 1, 1, 2), rows=Axis(4, 3, 1, 5), cols=Axis(4, 5, 1, 5), text=Axis(8, 8, 1, 12))
    ltx = dict(grid, frames=Axis(1, 1, 1, 2), text=Axis(16, 15, 1, 24))
    return {
        "flux": Space(image),
        "flux2": Space(image),
        "qwenimage": Space(dict(grid, text=Axis(8, 7, 1, 16)), masks=True),
        "wan": Space(video),
        "ltx": Space(ltx, masks=True),
        "qwenimage21": Space(dict(rows=Axis(2, 2, 1, 3), cols=Axis(2, 2, 1, 3), text=Axis(4, 4, 2, 8)), masks=True),
        "chronoedit": Space(video),
        # Helios's history latents are patched coarser than the video: only these sizes are known to fit.
        "helios": Space(dict(frames=Axis(2, 1, 1, 2), side=Axis(4, 3, 3, 4), long=Axis(16, 4, 4, 16, step=12))),
        "ltx2": Space(dict(grid, text=Axis(16, 15, 1, 24)), masks=True),
        "minimax_h3": Space(dict(video=Axis(8, 9, 1, 12), grid_width=Axis(4, 3, 1, 4), text=Axis(4, 4, 1, 6),
                                 audio=Axis(4, 4, 1, 6)), timesteps=False),
    }


#: What shapes each fixture takes (`paracheck.domain.shapes.Space`): base and uneven lengths, explore's ranges.
FIXTURE_SPACES = _spaces()


# -- pipelines ---------------------------------------------------------------------------------------------------

#: The pipeline fixtures (`fixtures/pipelines.py`): `<model>-pipeline` -> its tester class.
PIPELINE_FIXTURES: dict[str, str] = {
    f"{model}-pipeline": f"paracheck.fixtures.pipelines:{name}PipelineCase" for model, name in (
        ("flux", "Flux"), ("flux2", "Flux2"), ("qwenimage", "QwenImage"), ("wan", "Wan"), ("ltx", "LTX"),
        ("qwenimage21", "QwenImage21"), ("chronoedit", "ChronoEdit"), ("helios", "Helios"), ("ltx2", "LTX2"),
        ("flux-kontext", "FluxKontext"))
}
#: The other kinds of pipeline on those transformers (`fixtures/pipeline_kinds.py`: img2img, inpaint, fill,
#: control, edit, image-to-video, video-to-video, Flux2 Klein): `<name>-pipeline` -> (its transformer's model
#: fixture, its tester class's name).
PIPELINE_KINDS: dict[str, tuple[str, str]] = {
    "flux-img2img-pipeline": ("flux", "FluxImg2Img"), "flux-inpaint-pipeline": ("flux", "FluxInpaint"),
    "flux-fill-pipeline": ("flux", "FluxFill"), "flux-control-pipeline": ("flux", "FluxControl"),
    "flux-kontext-inpaint-pipeline": ("flux", "FluxKontextInpaint"), "flux2-klein-pipeline": ("flux2", "Flux2Klein"),
    "qwenimage-img2img-pipeline": ("qwenimage", "QwenImageImg2Img"),
    "qwenimage-inpaint-pipeline": ("qwenimage", "QwenImageInpaint"),
    "wan-i2v-pipeline": ("wan", "WanImageToVideo"), "wan-v2v-pipeline": ("wan", "WanVideoToVideo"),
    "ltx-i2v-pipeline": ("ltx", "LTXImageToVideo"), "ltx-condition-pipeline": ("ltx", "LTXCondition"),
    "ltx2-i2v-pipeline": ("ltx2", "LTX2ImageToVideo"), "flux-controlnet-pipeline": ("flux", "FluxControlNet"),
    "flux2-klein-inpaint-pipeline": ("flux2", "Flux2KleinInpaint"),
    "qwenimage-edit-pipeline": ("qwenimage", "QwenImageEdit"), "lucy-edit-pipeline": ("wan", "LucyEdit"),
    "flux-control-img2img-pipeline": ("flux", "FluxControlImg2Img"),
    "flux-control-inpaint-pipeline": ("flux", "FluxControlInpaint"),
    "flux-controlnet-img2img-pipeline": ("flux", "FluxControlNetImg2Img"),
    "flux-controlnet-inpaint-pipeline": ("flux", "FluxControlNetInpaint"),
    "qwenimage-controlnet-pipeline": ("qwenimage", "QwenImageControlNet"),
    "flux2-klein-kv-pipeline": ("flux2", "Flux2KleinKV"),
    "qwenimage-edit-plus-pipeline": ("qwenimage", "QwenImageEditPlus"),
    "ltx2-condition-pipeline": ("ltx2", "LTX2Condition"), "helios-pyramid-pipeline": ("helios", "HeliosPyramid"),
    "qwenimage-controlnet-inpaint-pipeline": ("qwenimage", "QwenImageControlNetInpaint"),
    "ltx2-in-context-pipeline": ("ltx2", "LTX2InContext"), "ltx2-hdr-pipeline": ("ltx2", "LTX2HDR"),
    "ltx2-dfr-pipeline": ("ltx2", "LTX2DFR"), "qwenimage-layered-pipeline": ("qwenimage", "QwenImageLayered"),
    "ltx2-dfr-temporal-refine-pipeline": ("ltx2", "LTX2DFRTemporalRefine"),
}
#: diffusers' pipelines on a planned transformer that no fixture bundles: class name -> the blocker, measured or read
#: in the pipeline's code (a test holds bundled and these to every such pipeline of the installed release).
PIPELINE_NOT_BUNDLED: dict[str, str] = {
    "VisualClozePipeline": "its `task_prompt` is required and refused beside `prompt_embeds`, and its `encode_prompt` "
                           "tokenizes the prompts whatever it is given (CLIP and T5 tokenizers: a download)",
    "VisualClozeGenerationPipeline": "as VisualClozePipeline: a required `task_prompt` always tokenized (CLIP and T5 "
                                     "tokenizers: a download)",
    "LTXI2VLongMultiPromptPipeline": "it takes no `prompt_embeds`: its prompts go through a T5 and its tokenizer (a "
                                     "download)",
    "QwenImageEditInpaintPipeline": "it denoises at a 1024x1024 area whatever `height` and `width` say: at a 32x VAE "
                                    "512 tokens and a 1024x1024 VAE encode and decode, 74 s a run on one device here "
                                    "(load 20), and a case runs it on the reference and on every rank",
}
PIPELINE_FIXTURES.update({name: f"paracheck.fixtures.pipeline_kinds:{cls}PipelineCase"
                          for name, (_, cls) in PIPELINE_KINDS.items()})
#: Each pipeline fixture's transformer, as the model fixture of that class is named (its plans, its class); a
#: pipeline built on another's transformer names it.
PIPELINE_TRANSFORMERS: dict[str, str] = dict({name: name.removesuffix("-pipeline") for name in PIPELINE_FIXTURES},
                                             **{"flux-kontext-pipeline": "flux"},
                                             **{name: model for name, (model, _) in PIPELINE_KINDS.items()})
#: diffusers' cache hooks, one variant each (`pipelines.caches`): the same cache on one device and in parallel.
CACHE_VARIANTS = ("first-block-cache", "faster-cache", "pyramid-attention-broadcast", "mag-cache", "taylorseer-cache",
                  "sea-cache", "text-kv-cache")
#: A pipeline's variants: base (its few steps), long (more steps), and the caches.
PIPELINE_VARIANTS = ("base", "long") + CACHE_VARIANTS
#: The layout kind each pipeline's one case of the default run takes: one CP and one TP layout between the pipelines
#: whose transformer has both, a CP layout for the others.
PIPELINE_DEFAULT_KIND: dict[str, str] = {
    "flux-pipeline": "u", "flux2-pipeline": "tp", "qwenimage-pipeline": "r", "wan-pipeline": "u", "ltx-pipeline": "r",
    "qwenimage21-pipeline": "tp", "chronoedit-pipeline": "u", "helios-pipeline": "u", "ltx2-pipeline": "u",
    "flux-kontext-pipeline": "r",
}
#: Pipelines the default run leaves to `--models pipelines` and `--all`: Helios's 40 blocks (its `_cp_plan` names
#: them) make one 4-rank case 21 s here, against 2 to 9 s for the others (measured, 2 shared cores); Flux Kontext's
#: transformer is Flux's, whose pipeline the default run takes; so is every other kind's (CI's budget is spent).
PIPELINE_NOT_DEFAULT = ("helios-pipeline", "flux-kontext-pipeline") + tuple(PIPELINE_KINDS)
#: The route of a pipeline's one case in the default run where it is not `auto`: its transformer loaded with a
#: `parallel_config` from a saved checkpoint, the other way a user makes it parallel.
PIPELINE_DEFAULT_ROUTE: dict[str, str] = {"flux2-pipeline": "sharded-load", "wan-pipeline": "sharded-load"}
