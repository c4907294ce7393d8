"""diffusers 0.42.1: ring attention applies a rank's own key mask to every KV chunk it visits.

    python docs/upstream/ring_mask_not_rotated.py           # 4 ranks, gloo, CPU

`TemplatedRingAttention.forward` rotates key and value around the ring but hands the same `attn_mask`
(the local chunk's) to every step. A per-key padding mask therefore masks the wrong keys as soon as
ranks' chunks pad differently. Runs diffusers' own ring and Ulysses code through `dispatch_attention_fn`
on CPU, using paracheck's float32 attention backend that returns the log-sum-exp.
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
B, S, H, D, WORLD = 1, 16, 4, 8, 4


def sdpa(q, k, v, mask):
    qkv = (x.transpose(1, 2).double() for x in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(*qkv, attn_mask=mask).transpose(1, 2)


def problem():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, generator=g) for _ in range(3))
    mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
    mask[..., -3:] = False  # three padding keys, all in the last rank's chunk
    return q, k, v, mask


def predicted(q, k, v, mask):
    """The cause's prediction: rank r's queries see every chunk through rank r's local mask."""
    rows = []
    for r in range(WORLD):
        local = mask.chunk(WORLD, -1)[r]
        rows.append(sdpa(q.chunk(WORLD, 1)[r], k, v, local.repeat(1, 1, 1, WORLD)))
    return torch.cat(rows, 1)


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
    q, k, v, mask = problem()
    want = sdpa(q, k, v, mask)
    local = [x.chunk(WORLD, 1)[rank] for x in (q, k, v)]
    for ring, ulysses in ((4, 1), (1, 4)):
        with cpu_lse_attention():
            out = dispatch_attention_fn(*local, attn_mask=mask.chunk(WORLD, -1)[rank],
                                        parallel_config=config(rank, ring, ulysses))
        out = gather(out)
        if rank == 0:
            line = f"ring {ring} x ulysses {ulysses}: output max abs error {float((out.double() - want).abs().max()):.1e}"
            if ring > 1:
                line += f"; vs. the cause's prediction {float((out.double() - predicted(q, k, v, mask)).abs().max()):.1e}"
            print(line)
    dist.barrier()  # ring all-gathers are never explicitly waited; keep gloo teardown orderly
    dist.destroy_process_group()


def gather(x):
    parts = [torch.empty_like(x) for _ in range(WORLD)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, 1)


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(tmp,), nprocs=WORLD)
