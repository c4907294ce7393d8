"""diffusers 0.42.1: TemplatedRingAttention.backward gets key/value gradients wrong at ring degree > 2.

    python docs/upstream/ring_backward_rotation.py          # 4 ranks, gloo, CPU
    python docs/upstream/ring_backward_rotation.py 2        # 2 ranks: everything matches

Runs diffusers' own ring attention (through `dispatch_attention_fn` with a real ParallelConfig) on CPU,
using paracheck's float32 attention backend that returns the log-sum-exp. Prints the worst error of the
gathered output and gradients against single-device float64 attention, then the same gradients
predicted from the cause, then the run again with the accumulator rotation reversed.
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
B, S, H, D = 1, 16, 2, 8


def sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)


def grads(q, k, v, grad_out):
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    out = sdpa(*leaves)
    out.backward(grad_out.double())
    return [out.detach()] + [x.grad for x in leaves]


def predicted_dkv(q, k, v, grad_out, world):
    """What the cause predicts rank c ends with: at step i the accumulator that started on rank c sits on
    rank c + i, which adds the gradient of chunk (c + i) + i from its own queries."""
    per_rank = [from_queries_of(r, q, k, v, grad_out, world) for r in range(world)]  # (dk, dv), all keys
    dk, dv = [], []
    for c in range(world):
        steps = [((c + i) % world, (c + 2 * i) % world) for i in range(world)]
        dk.append(sum(per_rank[r][0].chunk(world, 1)[chunk] for r, chunk in steps))
        dv.append(sum(per_rank[r][1].chunk(world, 1)[chunk] for r, chunk in steps))
    return torch.cat(dk, 1), torch.cat(dv, 1)


def from_queries_of(r, q, k, v, grad_out, world):
    """d(loss of rank r's queries) / d(all keys, all values)."""
    k_all, v_all = (x.double().requires_grad_() for x in (k, v))
    sdpa(q.chunk(world, 1)[r].double(), k_all, v_all).backward(grad_out.chunk(world, 1)[r].double())
    return k_all.grad, v_all.grad


def worker(rank, world, tmp):
    import contextlib

    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from torch.distributed.device_mesh import init_device_mesh

    from paracheck.adapters.diffusers.attention import cpu_lse_attention, reversed_ring_rotation

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), world), rank=rank,
                            world_size=world)
    cp = ContextParallelConfig(ring_degree=world)
    config = ParallelConfig(context_parallel_config=cp)
    config.setup(rank, world, torch.device("cpu"),
                 mesh=init_device_mesh("cpu", cp.mesh_shape, mesh_dim_names=cp.mesh_dim_names))
    g = torch.Generator().manual_seed(0)
    q, k, v, grad_out = (torch.randn(B, S, H, D, generator=g) for _ in range(4))
    want = grads(q, k, v, grad_out)
    for fixed in (False, True):
        leaves = [x.chunk(world, 1)[rank].clone().requires_grad_() for x in (q, k, v)]
        with cpu_lse_attention(), (reversed_ring_rotation() if fixed else contextlib.nullcontext()):
            out = dispatch_attention_fn(*leaves, parallel_config=config)
            out.backward(grad_out.chunk(world, 1)[rank])
        got = [gather(x, world) for x in [out.detach()] + [x.grad for x in leaves]]
        if rank == 0:
            label = "accumulators rotated to rank - 1 (fix)" if fixed else "diffusers 0.42.1 as shipped"
            errors = "  ".join(f"{n} {float((a.double() - b).abs().max()):.1e}"
                               for n, a, b in zip(("out", "dq", "dk", "dv"), got, want))
            print(f"ring degree {world}, {label}: max abs error  {errors}")
            if not fixed:
                dk, dv = predicted_dkv(q, k, v, grad_out, world)
                print(f"  observed dk, dv vs. predicted from the cause: "
                      f"{float((got[2].double() - dk).abs().max()):.1e}, {float((got[3].double() - dv).abs().max()):.1e}")
    dist.barrier()  # ring all-gathers are never explicitly waited; keep gloo teardown orderly
    dist.destroy_process_group()


def gather(x, world):
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, 1)


if __name__ == "__main__":
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(world, tmp), nprocs=world)
