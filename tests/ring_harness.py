"""Runs diffusers' context-parallel attention on a forked gloo world, op level (no model), for the tests.

Each case shards one seeded (q, k, v, grad) problem along the sequence, calls `dispatch_attention_fn`
with a real `ParallelConfig` inside `cpu_lse_attention`, gathers outputs and gradients, and reports
their worst error against single-device float64 attention.
"""

from __future__ import annotations

import json
import os
import tempfile

import torch
import torch.distributed as dist

from paracheck.rank.forked import fork_ranks
from tests.gloo_ranks import gloo_world

B, S, H, D = 1, 16, 4, 8


def run(world: int, cases: list[dict]) -> list[dict]:
    """Every case on one world of `world` ranks; rank 0's report per case."""
    with tempfile.TemporaryDirectory() as tmp:
        fork_ranks(_worker, (world, cases, tmp), world)
        with open(os.path.join(tmp, "results.json")) as handle:
            return json.load(handle)


def _worker(rank, world, cases, tmp):
    torch.set_num_threads(1)
    with gloo_world(rank, world, tmp):
        results = [_case(rank, world, **case) for case in cases]
        if rank == 0:
            with open(os.path.join(tmp, "results.json"), "w") as handle:
                json.dump(results, handle)


def problem(mask: bool):
    g = torch.Generator().manual_seed(7)
    q, k, v, grad = (torch.randn(B, S, H, D, generator=g) for _ in range(4))
    key_mask = None
    if mask:
        key_mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
        key_mask[..., -3:] = False  # padding keys, all in the last rank's chunk
    return q, k, v, grad, key_mask


def reference(q, k, v, grad, key_mask):
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(1, 2) for x in leaves), attn_mask=key_mask).transpose(1, 2)
    out.backward(grad.double())
    return [out.detach()] + [x.grad for x in leaves]


def _config(rank, world, ring, ulysses):
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    cp = ContextParallelConfig(ring_degree=ring, ulysses_degree=ulysses)
    config = ParallelConfig(context_parallel_config=cp)
    mesh = init_device_mesh("cpu", cp.mesh_shape, mesh_dim_names=cp.mesh_dim_names)
    config.setup(rank, world, torch.device("cpu"), mesh=mesh)
    return config


def _case(rank, world, ring=1, ulysses=1, fault=None, fixed=False, mask=False):
    import contextlib

    from diffusers.models.attention_dispatch import dispatch_attention_fn

    from paracheck.adapters.diffusers.attention import cpu_lse_attention
    from tests.specs import reversed_ring_rotation

    q, k, v, grad, key_mask = problem(mask)
    config = _config(rank, world, ring, ulysses)
    local = [x.chunk(world, dim=1)[rank] for x in (q, k, v, grad)]
    local_mask = None if key_mask is None else key_mask.chunk(world, dim=-1)[rank]
    leaves = [x.clone().requires_grad_() for x in local[:3]]
    report = dict(ring=ring, ulysses=ulysses, fault=fault, fixed=fixed, mask=mask)
    pending = _pending_collectives()
    try:
        with cpu_lse_attention(fault=fault), (reversed_ring_rotation() if fixed else contextlib.nullcontext()):
            out = dispatch_attention_fn(*leaves, attn_mask=local_mask, parallel_config=config)
            out.backward(local[3])
    except Exception as exc:  # every rank meets the same shapes, so all raise together
        return dict(report, raised=f"{type(exc).__name__}: {exc}")
    # Functional collectives issued and never waited for (torch keeps each, with its buffers, for good).
    report["unwaited"] = _pending_collectives() - pending
    got = [_gather(x, world) for x in [out.detach()] + [x.grad for x in leaves]]
    want = reference(q, k, v, grad, key_mask)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        report[name] = float((a.double() - b).abs().max())
    return report


def _pending_collectives() -> int:
    return torch._C._distributed_c10d._get_work_registry_size()


def _gather(x, world):
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=1)
