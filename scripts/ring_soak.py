"""A bounded stress of diffusers' ring attention on gloo, for the heap-corruption hunt (docs/ci.md).

    MALLOC_CHECK_=3 PYTHONFAULTHANDLER=1 nice -n 19 python scripts/ring_soak.py SECONDS SEED

Four ranks forked from the kit's fork server (`rank.forked`), each building two context-parallel configs once (ring 4;
ring 2 x Ulysses 2, diffusers' unified attention) and calling `dispatch_attention_fn` forward and backward through the
kit's CPU log-sum-exp op, with shapes drawn from SEED, until SECONDS have passed on every rank. Rank 0 prints the
calls made and how many functional collectives were left unwaited (torch's work registry). Run two at once to load
the cores as two 4-rank worlds did when ranks died; a crash shows as a rank's signal in the traceback raised here.
"""

import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def worker(rank, world, seconds, tmp, seed):
    import torch.distributed as dist
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    from paracheck.adapters.diffusers.attention import cpu_lse_attention
    from tests.gloo_ranks import gloo_world
    from tests.ring_harness import _config

    torch.set_num_threads(1)
    with gloo_world(rank, world, tmp):
        configs = [_config(rank, world, 4, 1), _config(rank, world, 2, 2)]
        g = torch.Generator().manual_seed(seed)
        end, calls = time.time() + seconds, 0
        while True:
            going = torch.tensor([time.time() < end], dtype=torch.int32)
            dist.all_reduce(going, op=dist.ReduceOp.MIN)  # every rank stops after the same call
            if not going.item():
                break
            s, h = 4 * int(torch.randint(1, 9, (1,), generator=g)), 4 * int(torch.randint(1, 3, (1,), generator=g))
            for config in configs:
                leaves = [torch.randn(1, s, h, 16, generator=g).requires_grad_() for _ in range(3)]
                with cpu_lse_attention():
                    out = dispatch_attention_fn(*leaves, parallel_config=config)
                    out.backward(torch.randn_like(out))
                calls += 1
        if rank == 0:
            pending = torch._C._distributed_c10d._get_work_registry_size()
            print(f"seed {seed}: {calls} forward+backward calls, {pending} collectives left unwaited", flush=True)


if __name__ == "__main__":
    from paracheck.rank.forked import fork_ranks

    seconds, seed = float(sys.argv[1]), int(sys.argv[2])
    with tempfile.TemporaryDirectory() as tmp:
        fork_ranks(worker, (4, seconds, tmp, seed), 4, timeout=seconds + 300)
