"""diffusers 0.42.1: TaylorSeer's first extrapolated step amplifies a rounding-level difference 10 to 70 times, on one
device, on a tiny Qwen-Image Layered pipeline.

    python docs/upstream/taylorseer_amplifies_rounding.py     # one process, CPU, no download; about a minute

Two runs of the same pipeline, the second with its prompt embedding scaled by 1 + 1e-7 (a difference the size of
fp32 rounding, as a parallel run's reduction order gives), six steps, with and without
`TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=2, max_order=1)`: the latents' largest difference
after each step. Without the cache it stays at rounding (2.4e-07 to 9.5e-07); with it, it jumps at step 3, the first
the cache extrapolates instead of computing, and again at step 5. Only diffusers and torch.
"""

import torch


class _DtypeAndDevice(torch.nn.Module):
    """What the pipeline asks of its Qwen2.5-VL text encoder with `prompt_embeds` given: a dtype and a device."""

    dtype = torch.float32

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    @property
    def device(self):
        return self.anchor.device


def pipeline():
    import diffusers

    torch.manual_seed(0)
    transformer = diffusers.QwenImageTransformer2DModel(
        patch_size=2, in_channels=32, out_channels=8, num_layers=2, attention_head_dim=16, num_attention_heads=3,
        joint_attention_dim=32, axes_dims_rope=(4, 6, 6), use_additional_t_cond=True, use_layer3d_rope=True)
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLQwenImage(base_dim=4, z_dim=8, input_channels=4, dim_mult=[1] * 6, num_res_blocks=1,
                                           temperal_downsample=[False, False, False, True, True],
                                           latents_mean=[0.0] * 8, latents_std=[1.0] * 8)
    pipe = diffusers.QwenImageLayeredPipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae,
                                              text_encoder=_DtypeAndDevice(), tokenizer=None, processor=None,
                                              transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run(cached: bool, scale: float) -> list:
    from PIL import Image
    import diffusers

    pipe = pipeline()
    if cached:
        pipe.transformer.enable_cache(diffusers.TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=2,
                                                                      max_order=1))
    g = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (64, 64, 3), generator=torch.Generator().manual_seed(4), dtype=torch.uint8)
    steps = []

    def after(pipeline, index, timestep, tensors):
        steps.append(tensors["latents"].clone())
        return {}
    mask = torch.ones(1, 8, dtype=torch.long)
    with torch.no_grad():
        pipe(prompt="a", image=Image.fromarray(pixels.numpy(), "RGB").convert("RGBA"), layers=1, resolution=640,
             prompt_embeds=torch.randn(1, 8, 32, generator=g) * scale, prompt_embeds_mask=mask,
             negative_prompt_embeds=torch.randn(1, 8, 32, generator=g), negative_prompt_embeds_mask=mask.clone(),
             true_cfg_scale=2.0, num_inference_steps=6, generator=torch.Generator().manual_seed(0), output_type="pt",
             callback_on_step_end=after, callback_on_step_end_tensor_inputs=["latents"])
    return steps


if __name__ == "__main__":
    for cached in (False, True):
        a, b = run(cached, 1.0), run(cached, 1.0 + 1e-7)
        print("TaylorSeer" if cached else "no cache  ", " ".join(f"{(x - y).abs().max():.1e}" for x, y in zip(a, b)))
