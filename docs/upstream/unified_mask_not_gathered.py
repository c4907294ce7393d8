"""diffusers 0.42.1: the unified ring x Ulysses path does not all-gather the attention mask.

    python docs/upstream/unified_mask_not_gathered.py       # 4 ranks (ring 2 x ulysses 2), gloo, CPU

`_templated_unified_attention` sends query, key and value through the Ulysses all-to-all (each rank's
sequence grows by the Ulysses degree, its heads shrink by it) but passes `attn_mask` on unchanged, so
a local key mask meets keys Ulysses-degree times as long. `TemplatedUlyssesAttention` (Ulysses alone)
all-gathers such a mask; this path lacks that step. Runs diffusers' own code through
`dispatch_attention_fn` on CPU, using paracheck's float32 attention backend that returns the log-sum-exp.
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
B, S, H, D, WORLD = 1, 24, 4, 8, 4


def config(rank, ring, ulysses):
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    cp = ContextParallelConfig(ring_degree=ring, ulysses_degree=ulysses)
    parallel = ParallelConfig(context_parallel_config=cp)
    parallel.setup(rank, WORLD, torch.device("cpu"),
                   mesh=init_device_mesh("cpu", cp.mesh_shape, mesh_dim_names=cp.mesh_dim_names))
    return parallel


def worker(rank, tmp):
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    from paracheck.adapters.diffusers.attention import cpu_lse_attention

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), WORLD), rank=rank,
                            world_size=WORLD)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, generator=g).chunk(WORLD, 1)[rank] for _ in range(3))
    mask = torch.ones(B, 1, 1, S // WORLD, dtype=torch.bool)  # all True: only its length matters
    for ring, ulysses, attn_mask in ((1, 4, mask), (2, 2, None), (2, 2, mask)):
        try:
            with cpu_lse_attention():
                dispatch_attention_fn(q, k, v, attn_mask=attn_mask, parallel_config=config(rank, ring, ulysses))
            result = "ok"
        except RuntimeError as exc:
            result = f"RuntimeError: {exc}"
        if rank == 0:
            shown = "none" if attn_mask is None else tuple(attn_mask.shape)
            print(f"ring {ring} x ulysses {ulysses}, local q {tuple(q.shape)}, mask {shown}: {result}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(tmp,), nprocs=WORLD)
