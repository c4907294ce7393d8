"""`checks.wholes`: many DTensors made whole by one collective per mesh and dtype, on a forked 4-rank gloo world,
held to torch's own `full_tensor()` for every placement pair of a 2 x 2 mesh, uneven shapes, a 1-D mesh, a
sub-mesh, plain tensors and None; a replica that diverged stays visible as `full_tensor()` shows it."""

import itertools
import tempfile

import pytest
import torch

from paracheck.rank.forked import fork_ranks
from tests.gloo_ranks import answer, answers, gloo_world


def _tensors(mesh2, mesh1):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    placements = [Replicate(), Shard(0), Shard(1)]
    tensors = {}
    for (i, pair), shape in itertools.product(enumerate(itertools.product(placements, placements)),
                                              [(5, 3), (8, 6), (1, 7)]):
        tensors[f"mesh2 {i} {shape}"] = distribute_tensor(torch.randn(shape), mesh2, list(pair))
    for i, p in enumerate(placements):
        tensors[f"mesh1 {i}"] = distribute_tensor(torch.randn(6, 5), mesh1, [p])
    tensors["submesh"] = distribute_tensor(torch.randn(6, 5), mesh2["b"], [Shard(0)])  # full_tensor()'s way
    tensors["bf16"] = distribute_tensor(torch.randn(4, 4).bfloat16(), mesh2, [Shard(0), Shard(1)])
    tensors["plain"], tensors["none"] = torch.randn(3), None
    return tensors


def _worker(rank: int, tmp: str) -> None:
    with gloo_world(rank, 4, tmp):
        answer(tmp, rank, _found(rank))


def _found(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from paracheck.checks.wholes import wholes

    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    mesh1 = init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    tensors = _tensors(mesh2, mesh1)
    got = wholes(tensors)
    wrong = [n for n, t in tensors.items()
             if not (t is None and got[n] is None or torch.equal(got[n], t.full_tensor() if hasattr(t, "full_tensor")
                                                                 else t))]
    diverged = distribute_tensor(torch.ones(4, 2), mesh2, [Replicate(), Shard(0)])
    if rank == 3:
        diverged.to_local().add_(1)  # rank 3's rows differ from its replica's, rank 1's
    seen = wholes({"d": diverged})["d"]
    return {"wrong": wrong, "order": list(got) == list(tensors), "diverged": seen.sum().item(),
            "full": diverged.full_tensor().sum().item()}


@pytest.mark.slow
def test_wholes_are_full_tensors_on_every_rank():
    with tempfile.TemporaryDirectory() as tmp:
        fork_ranks(_worker, (tmp,), 4, timeout=120)
        got = answers(tmp, 4)
    assert all(g["wrong"] == [] and g["order"] for g in got), got
    # Ranks 2 and 3 (coordinate 1 on the replicated dimension) put rank 3's rows in; ranks 0 and 1 rank 1's.
    assert [g["diverged"] for g in got] == [g["full"] for g in got] == [8.0, 8.0, 12.0, 12.0]
