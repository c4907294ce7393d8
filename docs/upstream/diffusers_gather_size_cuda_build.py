"""diffusers 0.42.1: `gather_size_by_comm` gathers on CUDA over a plain "gloo" group when torch is a CUDA build,
even on a machine with no GPU.

    python docs/upstream/diffusers_gather_size_cuda_build.py      # a CUDA build of torch, no GPU; 2 gloo ranks

`gather_size_by_comm` (models/_modeling_parallel.py; ulysses_anything and ring_anything call it) gathers on the CPU
only when the group's backend string contains "cpu", else on `torch.accelerator.current_accelerator()`, which a CUDA
build names whether a GPU is there or not. Ranks forked from a parent that touched CUDA then fail with "Cannot
re-initialize CUDA in forked subprocess"; spawned ones with no driver fail to initialize CUDA. A group made as
"cpu:gloo" gathers on the CPU. No paracheck code runs here.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank, store_dir, backend, out):
    from diffusers.models._modeling_parallel import gather_size_by_comm

    dist.init_process_group(backend, store=dist.FileStore(os.path.join(store_dir, "store"), 2), rank=rank, world_size=2)
    try:
        out[rank] = f"gathered {gather_size_by_comm(rank + 3, dist.group.WORLD)}"
    except Exception as exc:
        out[rank] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    dist.destroy_process_group()


if __name__ == "__main__":
    print(f"torch {torch.__version__}, CUDA build: {torch.version.cuda is not None}, GPU: {torch.cuda.is_available()}, "
          f"current_accelerator(): {torch.accelerator.current_accelerator()}")
    for backend in ("gloo", "cpu:gloo"):
        with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
            out = manager.dict()
            mp.start_processes(rank_main, args=(tmp, backend, out), nprocs=2, start_method="spawn")
            print(f"backend {backend!r:11} rank 0: {out[0]}; rank 1: {out[1]}")
