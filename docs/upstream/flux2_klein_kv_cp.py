"""diffusers 0.42.1: Flux2KleinKVPipeline's KV-cache attention processors under context parallelism.

    python docs/upstream/flux2_klein_kv_cp.py               # 2 ranks, gloo, CPU

The pipeline's constructor swaps every attention processor of its transformer for a KV-cache one
(`_set_kv_attn_processors`): a transformer made parallel before (loaded with a `parallel_config`, or
`enable_parallelism` first) loses its processors' CP config. Made parallel after, the first step's "extract" call
(reference tokens first, `num_ref_tokens` counted over the whole sequence) meets this rank's share of the tokens.
Runs a tiny Flux2 transformer from its config under Ulysses 2, both orders, the extract call as the pipeline makes it.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD, REF, IMAGE, TEXT = 2, 64, 16, 8


def model():
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(0)
    return Flux2Transformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                   timestep_guidance_channels=32, mlp_ratio=2.0, axes_dims_rope=(4, 4, 4, 4),
                                   guidance_embeds=False).eval()


def kv_processors(transformer):
    """What Flux2KleinKVPipeline.__init__ does to its transformer (`_set_kv_attn_processors`)."""
    from diffusers.models.transformers.transformer_flux2 import (Flux2KVAttnProcessor,
                                                                 Flux2KVParallelSelfAttnProcessor)

    for block in transformer.transformer_blocks:
        block.attn.set_processor(Flux2KVAttnProcessor())
    for block in transformer.single_transformer_blocks:
        block.attn.set_processor(Flux2KVParallelSelfAttnProcessor())


def extract(transformer):
    """The pipeline's first step: the reference picture's tokens before the denoised ones, the KV cache extracted."""
    g = torch.Generator().manual_seed(0)
    ids = torch.zeros(1, REF + IMAGE, 4)
    ids[0, :, 3] = torch.arange(REF + IMAGE)
    return transformer(hidden_states=torch.randn(1, REF + IMAGE, 4, generator=g), timestep=torch.tensor([0.5]),
                       encoder_hidden_states=torch.randn(1, TEXT, 32, generator=g), img_ids=ids,
                       txt_ids=torch.zeros(1, TEXT, 4), guidance=None, return_dict=False, kv_cache_mode="extract",
                       num_ref_tokens=REF)[0]


def worker(rank, tmp):
    from diffusers import ContextParallelConfig

    torch.set_num_threads(1)
    # enable_parallelism picks `rank % torch.accelerator.device_count()`: a modulo by zero on a CPU-only machine.
    torch.accelerator.device_count = lambda: 1
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), WORLD), rank=rank,
                            world_size=WORLD)
    reference = model()
    kv_processors(reference)
    with torch.no_grad():
        want = extract(reference)
    for order in ("parallel first", "KV processors first"):
        parallel = model()
        if order == "KV processors first":
            kv_processors(parallel)
        parallel.enable_parallelism(config=ContextParallelConfig(ulysses_degree=WORLD))
        if order == "parallel first":
            kv_processors(parallel)
        held = parallel.transformer_blocks[0].attn.processor._parallel_config is not None
        try:
            with torch.no_grad():
                line = f"max abs difference {float((extract(parallel) - want).abs().max()):.1e}"
        except RuntimeError as exc:
            line = f"RuntimeError: {exc}"
        if rank == 0:
            print(f"{order}: processors hold the CP config: {held}; extract call: {line}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(tmp,), nprocs=WORLD)
