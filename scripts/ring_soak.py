"""A bounded stress of diffusers' ring attention on gloo, for the heap-corruption hunt (docs/ci.md).

    ulimit -c unlimited
    LD_PRELOAD=/lib/x86_64-linux-gnu/libc_malloc_debug.so.0 MALLOC_CHECK_=3 PYTHONFAULTHANDLER=1 \
        nice -n 19 python scripts/ring_soak.py SECONDS SEED [--churn]

Heap checking on glibc >= 2.34: `MALLOC_CHECK_` alone does nothing there (the checks moved out of libc into
libc_malloc_debug.so), so preload that library as above, or nothing is checked. With it, every allocation made
through the dynamic linker (libtorch's, gloo's, CPython's) gets a guard byte after its end and tcache is off, so an
overrun, a bad free or a double free aborts at the free that meets it ("free(): invalid pointer"). Each rank checks
that the library is mapped and the variable set whenever either is asked for, and stops if not (an unchecked soak
must not pass for a checked one). How the preload was verified on this machine: docs/ci.md, "The ring crash".

Four ranks forked from the kit's fork server (`rank.forked`; a fork server started here inherits this process's
environment, the preload included), each building two context-parallel configs once (ring 4; ring 2 x Ulysses 2,
diffusers' unified attention) and calling `dispatch_attention_fn` forward and backward through the kit's CPU
log-sum-exp op, with shapes drawn from SEED, until SECONDS have passed on every rank. `--churn` also does what a kit
rank does between cases (`rank.worker._release_memory`: a full collection, then `malloc_trim(0)`) and allocates
and frees a burst of small (tcache-sized) tensors after every call; and inside every call of the op pair (wrapped
through `library.templated_ops`), so while the ring's KV all-gather or gradient rotation is still in flight on
gloo's threads, the same less the collection.
Rank 0 prints the calls made and how many functional collectives were left unwaited (torch's work registry). Run
two at once to load the cores as two 4-rank worlds did when ranks died; a crash shows as a rank's signal in the
traceback raised here.
"""

import ctypes
import gc
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEBUG_LIB = "libc_malloc_debug.so"


def malloc_debug_state() -> tuple[bool, bool]:
    """(libc_malloc_debug mapped in this process, MALLOC_CHECK_ or the glibc.malloc.check tunable set)."""
    with open("/proc/self/maps") as maps:
        mapped = DEBUG_LIB in maps.read()
    asked = bool(os.environ.get("MALLOC_CHECK_")) or "glibc.malloc.check" in os.environ.get("GLIBC_TUNABLES", "")
    return mapped, asked


def _check_malloc_debug(rank: int) -> None:
    mapped, asked = malloc_debug_state()
    if asked and not mapped:
        raise SystemExit(f"rank {rank}: MALLOC_CHECK_ set but {DEBUG_LIB} not preloaded: nothing would be checked")
    if rank == 0:
        print(f"heap checking: {'on' if mapped and asked else 'off'}", flush=True)


def _churn(libc, g, collect=True) -> None:
    if collect:
        gc.collect()
    libc.malloc_trim(0)
    [torch.randn(int(n)) for n in torch.randint(1, 200, (64,), generator=g)]  # tcache-sized, freed at once


def _churning(libc, g):
    """An op-pair wrapper (`library.templated_ops`) that churns the heap before each op runs."""
    def after_churn(op):
        def run(*args, **kwargs):
            _churn(libc, g, collect=False)
            return op(*args, **kwargs)
        return run

    return lambda forward, backward: (after_churn(forward), after_churn(backward))


def worker(rank, world, seconds, tmp, seed, churn):
    import contextlib

    import torch.distributed as dist
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    from paracheck.adapters.diffusers import library
    from paracheck.adapters.diffusers.attention import cpu_lse_attention
    from tests.gloo_ranks import gloo_world
    from tests.ring_harness import _config

    _check_malloc_debug(rank)
    libc = ctypes.CDLL("libc.so.6")
    torch.set_num_threads(1)
    with gloo_world(rank, world, tmp):
        configs = [_config(rank, world, 4, 1), _config(rank, world, 2, 2)]
        g = torch.Generator().manual_seed(seed)
        gc_g = torch.Generator().manual_seed(seed + 1)  # the churn's own draws, so shapes match a run without it
        end, calls = time.time() + seconds, 0
        while True:
            going = torch.tensor([time.time() < end], dtype=torch.int32)
            dist.all_reduce(going, op=dist.ReduceOp.MIN)  # every rank stops after the same call
            if not going.item():
                break
            s, h = 4 * int(torch.randint(1, 9, (1,), generator=g)), 4 * int(torch.randint(1, 3, (1,), generator=g))
            for config in configs:
                leaves = [torch.randn(1, s, h, 16, generator=g).requires_grad_() for _ in range(3)]
                churning = library.templated_ops(_churning(libc, gc_g)) if churn else contextlib.nullcontext()
                with cpu_lse_attention(), churning:
                    out = dispatch_attention_fn(*leaves, parallel_config=config)
                    out.backward(torch.randn_like(out))
                calls += 1
                if churn:
                    _churn(libc, gc_g)
        if rank == 0:
            pending = torch._C._distributed_c10d._get_work_registry_size()
            print(f"seed {seed}: {calls} forward+backward calls, {pending} collectives left unwaited", flush=True)


if __name__ == "__main__":
    from paracheck.rank.forked import fork_ranks

    seconds, seed, churn = float(sys.argv[1]), int(sys.argv[2]), "--churn" in sys.argv[3:]
    with tempfile.TemporaryDirectory() as tmp:
        fork_ranks(worker, (4, seconds, tmp, seed, churn), 4, timeout=seconds + 300)
