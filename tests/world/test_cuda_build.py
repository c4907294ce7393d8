"""A CUDA build of torch on a machine with no GPU: the kit's gloo groups keep diffusers' collectives on the CPU.

diffusers' `gather_size_by_comm` (ulysses_anything, ring_anything: the `uneven` variants) gathers on the CPU only
when the group's backend string says "cpu", else on `torch.accelerator.current_accelerator()`. A CUDA build names
CUDA there even with no GPU (torch 2.14.1+cu130 here: `cuda`), and the forked ranks then fail with "Cannot
re-initialize CUDA in forked subprocess". This CPU build answers None, so the stand-in makes it answer `cuda` as the
CUDA build does; diffusers' own function then runs on the kit's own world (`rank.worker.join`) and on a plain
"gloo" group beside it, the negative control: there the stand-in must reach CUDA and fail.
"""

import os
import tempfile

import pytest

from paracheck.rank.forked import fork_ranks
from tests.gloo_ranks import answer, answers

pytestmark = pytest.mark.slow


def _worker(rank: int, tmp: str) -> None:
    import torch
    import torch.distributed as dist
    from diffusers.models._modeling_parallel import gather_size_by_comm

    from paracheck.domain.backends import get_backend
    from paracheck.adapters.diffusers.layout import DiffusersLayout
    from paracheck.rank.worker import join
    from paracheck.world.meshes import Meshes

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", GLOO_SOCKET_IFNAME="lo")
    join(get_backend("gloo"), os.path.join(tmp, "store"))
    torch.accelerator.current_accelerator = lambda check_available=False: torch.device("cuda")
    ring = Meshes(world=dist.group.WORLD).along(DiffusersLayout.parse("r2"), ("ring", "ulysses"), "cpu")["ring"].get_group()
    plain = dist.new_group([0, 1], backend="gloo")
    found = {"kit": str(dist.get_backend(ring)), "sizes": gather_size_by_comm(rank + 3, ring)}
    try:
        gather_size_by_comm(rank + 3, plain)
        found["plain"] = "gathered"
    except (RuntimeError, AssertionError) as exc:
        found["plain"] = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    answer(tmp, rank, found)
    dist.destroy_process_group()


def test_gloo_groups_keep_diffusers_uneven_gathers_on_the_cpu():
    with tempfile.TemporaryDirectory() as tmp:
        fork_ranks(_worker, (tmp,), 2, timeout=120)
        found = answers(tmp, 2)
    for rank, got in enumerate(found):
        assert "cpu" in got["kit"], f"rank {rank}: the kit's ring group is {got['kit']!r}"
        assert got["sizes"] == [3, 4], f"rank {rank}: {got['sizes']}"
        # The control: on a plain "gloo" group the same call goes to CUDA and raises ("Torch not compiled with CUDA
        # enabled" on a CPU build; on a CUDA build with no GPU "Found no NVIDIA driver" or "Cannot re-initialize CUDA").
        assert got["plain"] != "gathered", f"rank {rank}: a plain gloo group gathered: the stand-in reached no CUDA"
