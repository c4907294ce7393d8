"""`DiffusersPipelineParallelTesterMixin` on a test class written as diffusers writes its pipeline tests: a config
class with `pipeline_class`, `get_dummy_components()` (tiny models from configs, no download) and
`get_dummy_inputs(device, seed)`, inherited next to the mixin. Its structure, pipeline and control tests run as the
mixin generates them (a 2-rank gloo world, launched once for the class)."""

from __future__ import annotations

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

from paracheck.testing import DiffusersPipelineParallelTesterMixin


class FluxPipelineFastTestsConfig:
    """As diffusers' Flux pipeline tester builds its components, the text encoders left out: the prompt comes as
    `prompt_embeds` (the encoders' tokenizers would be a download)."""

    pipeline_class = FluxPipeline

    def get_dummy_components(self):
        torch.manual_seed(0)
        transformer = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                             attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                             pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])
        torch.manual_seed(0)
        vae = AutoencoderKL(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1,
                            latent_channels=1, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
                            shift_factor=0.0609, scaling_factor=1.5035)
        return {"scheduler": FlowMatchEulerDiscreteScheduler(), "text_encoder": None, "text_encoder_2": None,
                "tokenizer": None, "tokenizer_2": None, "transformer": transformer, "vae": vae}

    def get_dummy_inputs(self, device, seed=0):
        generator = torch.Generator(device="cpu").manual_seed(seed)
        embeds = torch.Generator().manual_seed(seed + 1)
        return {"prompt_embeds": torch.randn(1, 8, 32, generator=embeds),
                "pooled_prompt_embeds": torch.randn(1, 32, generator=embeds), "generator": generator,
                "num_inference_steps": 2, "guidance_scale": 5.0, "height": 8, "width": 8, "output_type": "pt"}


class TestFluxPipelineParallel(FluxPipelineFastTestsConfig, DiffusersPipelineParallelTesterMixin):
    paracheck_layouts = ("tp2", "u2")
