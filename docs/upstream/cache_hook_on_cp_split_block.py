"""diffusers 0.42.1: cache hooks on the block where the context-parallel plan splits the sequence.

    python docs/upstream/cache_hook_on_cp_split_block.py     # 2 ranks (Ulysses 2), gloo, CPU, no download

Wan's `_cp_plan` splits the sequence at `blocks.0`'s input (QwenImage's at `transformer_blocks.0`'s). The first-block
cache and MagCache put their head hook on that same block and subtract the block's input from its output: enabled
after `enable_parallelism`, the hook holds the whole sequence (8 tokens) and the block returns this rank's 4, and
the subtraction raises. SeaCache raises nothing: under CP it never records a residual, so every hit it selects
falls back to full execution ("selected a cache hit without residual history; running in fail-open mode") and the
parallel pipeline's output is the uncached one, not what the same cache gives on one device. Only diffusers and
torch: a tiny Wan transformer and WanPipeline from configs (the prompt as `prompt_embeds`).
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def transformer():
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
                                 out_channels=4, text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2,
                                 rope_max_seq_len=32).eval()


def cache(name):
    import diffusers

    if name == "first-block cache":
        return diffusers.FirstBlockCacheConfig(threshold=0.8)
    return diffusers.MagCacheConfig(threshold=0.5, num_inference_steps=2, mag_ratios=torch.ones(2))


def pipeline(parallel: bool, sea: bool):
    """A tiny WanPipeline, its transformer under Ulysses 2 if `parallel`, SeaCache on if `sea`."""
    import diffusers

    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLWan(base_dim=3, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                     temperal_downsample=[False, True, True], latents_mean=[0.0] * 4,
                                     latents_std=[1.0] * 4)
    pipe = diffusers.WanPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=transformer(),
                                 scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0))
    pipe.set_progress_bar_config(disable=True)
    if parallel:
        pipe.transformer.enable_parallelism(config=diffusers.ContextParallelConfig(ulysses_degree=WORLD))
    if sea:
        pipe.transformer.enable_cache(diffusers.SeaCacheConfig(threshold=0.8, retention_steps=1, cache_end_steps=1))
    g = torch.Generator().manual_seed(1)
    embeds, negative = torch.randn(1, 8, 32, generator=g), torch.randn(1, 8, 32, generator=g)
    with torch.no_grad():
        return pipe(prompt_embeds=embeds, negative_prompt_embeds=negative, height=32, width=32, num_frames=5,
                    num_inference_steps=6, generator=torch.Generator().manual_seed(0), output_type="pt").frames


def step(model, inputs):
    with torch.no_grad(), model.cache_context("cond"):
        return model(**inputs, return_dict=False)[0]


def worker(rank, tmp):
    from diffusers import ContextParallelConfig

    torch.set_num_threads(1)
    # enable_parallelism picks `rank % torch.accelerator.device_count()`: a modulo by zero on a CPU-only machine.
    torch.accelerator.device_count = lambda: 1
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), WORLD), rank=rank,
                            world_size=WORLD)
    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 4, 2, 4, 4, generator=g), timestep=torch.tensor([900.0]),
                  encoder_hidden_states=torch.randn(1, 8, 32, generator=g))  # 2 frames x 2 x 2 = 8 tokens
    for name in ("first-block cache", "MagCache"):
        for order in ("parallelism, then cache", "cache, then parallelism"):
            model = transformer()
            try:
                single = transformer()
                single.enable_cache(cache(name))
                step(single, inputs)  # one device: fine
                if order.startswith("parallelism"):
                    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=WORLD))
                    model.enable_cache(cache(name))
                else:
                    model.enable_cache(cache(name))
                    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=WORLD))
                step(model, inputs)
                result = "ok"
            except RuntimeError as exc:
                result = f"RuntimeError: {exc}"
            if rank == 0:
                print(f"{name}, {order}: {result}")
            dist.barrier()
    outputs = {(parallel, sea): pipeline(parallel, sea) for parallel in (False, True) for sea in (False, True)}
    if rank == 0:
        def gap(a, b):
            return float((outputs[a] - outputs[b]).abs().max())
        print(f"SeaCache, one device: {gap((False, True), (False, False)):.3f} from the uncached output")
        print(f"SeaCache, Ulysses 2: {gap((True, True), (True, False)):.3f} from the uncached output, "
              f"{gap((True, True), (False, True)):.3f} from the same cache on one device")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(tmp,), nprocs=WORLD)
