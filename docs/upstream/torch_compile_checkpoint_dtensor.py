"""torch 2.13: torch.compile (aot_eager or inductor) of a checkpoint_wrapper'd attention block whose projections are
tensor-parallel (DTensors), calling scaled_dot_product_attention, raises in the training forward. Runs without
paracheck, on 2 CPU gloo ranks:

    python docs/upstream/torch_compile_checkpoint_dtensor.py                # aot_eager: AssertionError
    python docs/upstream/torch_compile_checkpoint_dtensor.py inductor       # the same
    python docs/upstream/torch_compile_checkpoint_dtensor.py eager          # backend="eager": runs
    python docs/upstream/torch_compile_checkpoint_dtensor.py aot_eager math # softmax(q k^T) v by hand: runs
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim=32, heads=4, sdpa=True):
        super().__init__()
        self.head_dim, self.sdpa = dim // heads, sdpa
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.q, self.k, self.v))
        if self.sdpa:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = torch.softmax(q @ k.transpose(-1, -2), -1) @ v
        return x + self.o(out.transpose(1, 2).reshape(b, s, -1))


def main(rank, world, backend, sdpa):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29577")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel()}
    block = parallelize_module(Attention(sdpa=sdpa), mesh, plan)
    block = torch.compile(checkpoint_wrapper(block, preserve_rng_state=False), backend=backend, fullgraph=True)
    try:
        block(torch.randn(2, 8, 32)).sum().backward()
        print(f"rank {rank}: backend={backend} sdpa={sdpa}: forward and backward ran", flush=True)
    except Exception as exc:
        print(f"rank {rank}: backend={backend} sdpa={sdpa}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(main, args=(2, sys.argv[1] if len(sys.argv) > 1 else "aot_eager", sys.argv[2:] != ["math"]), nprocs=2)
