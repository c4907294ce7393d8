"""diffusers 0.42.1: under context parallelism the first-block cache decides per rank, from the rank's own shard.

    python docs/upstream/fbc_local_decision.py     # 2 ranks (Ulysses 2), gloo, CPU, no download; about a minute

`FBCHeadBlockHook._should_compute_remaining_blocks` compares the head block's residual with the previous one on the
tensors it holds: under CP, this rank's shard of the sequence. Nothing agrees the decision across the CP group (as
SeaCache's `_synchronize_compute_decision` does), so where the ranks' ratios fall on both sides of the threshold one
rank skips the remaining blocks and another runs them, alone in their all-to-all, until gloo times out. The run
first records each rank's ratios at a threshold that reuses everything, then puts the threshold between two ranks'
ratios at the first call where they differ, as a user's threshold may fall. Only diffusers and torch: a tiny
FluxPipeline from configs (the prompt as `prompt_embeds`).
"""

import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def pipeline(threshold: float):
    import diffusers

    torch.manual_seed(0)
    transformer = diffusers.FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                                   attention_head_dim=16, num_attention_heads=2,
                                                   joint_attention_dim=32, pooled_projection_dim=32,
                                                   axes_dims_rope=(4, 4, 8))
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,),
                                  layers_per_block=1, latent_channels=1, norm_num_groups=1, use_quant_conv=False,
                                  use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035)
    pipe = diffusers.FluxPipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None,
                                  tokenizer=None, text_encoder_2=None, tokenizer_2=None, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.enable_parallelism(config=diffusers.ContextParallelConfig(ulysses_degree=WORLD))
    pipe.transformer.enable_cache(diffusers.FirstBlockCacheConfig(threshold=threshold))
    return pipe


def run(threshold: float, ratios: list) -> str:
    from diffusers.hooks import first_block_cache

    original = first_block_cache.FBCHeadBlockHook._should_compute_remaining_blocks

    def recorded(self, residual):
        previous = self.state_manager.get_state().head_block_residual
        if previous is not None:
            ratios.append(float((residual - previous).abs().mean() / previous.abs().mean()))
        return original(self, residual)

    first_block_cache.FBCHeadBlockHook._should_compute_remaining_blocks = recorded
    g = torch.Generator().manual_seed(1)
    embeds = dict(prompt_embeds=torch.randn(1, 8, 32, generator=g), pooled_prompt_embeds=torch.randn(1, 32, generator=g),
                  negative_prompt_embeds=torch.randn(1, 8, 32, generator=g),
                  negative_pooled_prompt_embeds=torch.randn(1, 32, generator=g))
    try:
        with torch.no_grad():
            pipeline(threshold)(**embeds, true_cfg_scale=2.0, height=8, width=8, num_inference_steps=6,
                                generator=torch.Generator().manual_seed(0), output_type="pt")
        return "finished"
    except RuntimeError as exc:
        return f"RuntimeError: {str(exc).splitlines()[0][:120]}"
    finally:
        first_block_cache.FBCHeadBlockHook._should_compute_remaining_blocks = original


def worker(rank, tmp):
    torch.set_num_threads(1)
    # enable_parallelism picks `rank % torch.accelerator.device_count()`: a modulo by zero on a CPU-only machine.
    torch.accelerator.device_count = lambda: 1
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), WORLD), rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=30))
    ratios: list = []
    run(100.0, ratios)  # reuses after every first call: records every rank's ratio at each call
    every = [None] * WORLD
    dist.all_gather_object(every, ratios)
    call = next(i for i, values in enumerate(zip(*every)) if max(values) - min(values) > 1e-3)
    threshold = (min(r[call] for r in every) + max(r[call] for r in every)) / 2
    if rank == 0:
        print(f"ratios at call {call + 1}: " + ", ".join(f"rank {r} {every[r][call]:.4f}" for r in range(WORLD))
              + f"; threshold {threshold:.4f}")
    decided: list = []
    result = run(threshold, decided)
    print(f"rank {rank}: {result}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(tmp,), nprocs=WORLD)
