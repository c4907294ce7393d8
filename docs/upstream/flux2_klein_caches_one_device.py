"""diffusers 0.42.1: two caches that FLUX.2 Klein's pipelines cannot run, on one device, no parallelism.

    python docs/upstream/flux2_klein_caches_one_device.py     # one process, CPU; tiny components, no download

1. `Flux2KleinPipeline` with the first-block cache: the head block (Flux2's dual-stream block) returns a pair, which
   the cache keeps as a list; the tail block (a single-stream block) returns one tensor, and the tail hook subtracts
   the list from it (`TypeError: unsupported operand type(s) for -: 'Tensor' and 'list'`, first_block_cache.py,
   `FBCBlockHook.new_forward`). Flux2's own pipeline enters no cache context, so it never gets that far.
2. `Flux2KleinKVPipeline` with FasterCache or pyramid attention broadcast: its first step runs the reference picture's
   tokens beside the denoised ones (1024 + 16 here) to fill its key/value cache, later steps the 16 alone; both
   caches hand a later step an attention output kept from an earlier one, so a 1040-token output meets a 16-token
   step (`The size of tensor a (16) must match the size of tensor b (1040)`).
Each is also run without the cache, which passes, and the script prints what each run gave.
"""

import torch
from PIL import Image


def components(guidance_embeds: bool) -> dict:
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    torch.manual_seed(0)
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, timestep_guidance_channels=32, mlp_ratio=2.0, axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=guidance_embeds)
    vae = AutoencoderKLFlux2(sample_size=32, in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
                             up_block_types=("UpDecoderBlock2D",), block_out_channels=(4,), layers_per_block=1,
                             latent_channels=1, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False)
    return dict(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None,
                transformer=transformer)


def embeds(seed: int) -> torch.Tensor:
    return torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(seed))


def run(label: str, pipe, cache, **inputs) -> None:
    if cache is not None:
        pipe.transformer.enable_cache(cache)
    try:
        out = pipe(prompt_embeds=embeds(0), height=8, width=8, num_inference_steps=3,
                   generator=torch.Generator().manual_seed(0), output_type="pt", **inputs).images
        print(f"{label}: ran, images {tuple(out.shape)}")
    except Exception as exc:  # the failure is what this script shows
        print(f"{label}: {type(exc).__name__}: {exc}")
    finally:
        if cache is not None:
            pipe.transformer.disable_cache()


def main() -> None:
    import diffusers
    from diffusers import FasterCacheConfig, FirstBlockCacheConfig, PyramidAttentionBroadcastConfig
    from diffusers import Flux2KleinKVPipeline, Flux2KleinPipeline

    print(f"diffusers {diffusers.__version__}")
    klein = Flux2KleinPipeline(**components(guidance_embeds=False))
    for label, cache in (("Klein, no cache", None), ("Klein, first-block cache", FirstBlockCacheConfig(threshold=0.8))):
        run(label, klein, cache, negative_prompt_embeds=embeds(1))
    kv = Flux2KleinKVPipeline(**components(guidance_embeds=False))
    picture = Image.fromarray(torch.randint(0, 256, (64, 64, 3), generator=torch.Generator().manual_seed(4),
                                            dtype=torch.uint8).numpy(), "RGB")
    top = lambda: 1000 if kv.current_timestep is None else kv.current_timestep  # noqa: E731
    faster = FasterCacheConfig(spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 901),
                               unconditional_batch_skip_range=2, unconditional_batch_timestep_skip_range=(-1, 901),
                               attention_weight_callback=lambda module: 0.5, current_timestep_callback=top,
                               is_guidance_distilled=True)
    pyramid = PyramidAttentionBroadcastConfig(spatial_attention_block_skip_range=2,
                                              spatial_attention_timestep_skip_range=(-1, 1001),
                                              current_timestep_callback=lambda: kv.current_timestep)
    for label, cache in (("Klein KV, no cache", None), ("Klein KV, FasterCache", faster),
                         ("Klein KV, pyramid attention broadcast", pyramid)):
        run(label, kv, cache, image=picture)


if __name__ == "__main__":
    main()
