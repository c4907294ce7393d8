"""The transformers gradient check on a forked 2-rank gloo world, where one rank holds a sharded parameter's
gradient and the other none (its tokens reached none of an expert pool's weights: longcat_flash's routed experts
under tf-router-topk-on-shard, whose ranks 2-3 routed only to identity experts and aborted the world)."""

import tempfile

import pytest
import torch

from paracheck.rank.forked import fork_ranks
from tests.gloo_ranks import answer, answers, gloo_world


def _worker(rank: int, tmp: str) -> None:
    with gloo_world(rank, 2, tmp):
        answer(tmp, rank, _found(rank))


def _found(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from paracheck.adapters.transformers import localize
    from paracheck.adapters.transformers.layout import TfLayout

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    whole = torch.randn(4, 3)
    model = torch.nn.Module()
    model.experts = torch.nn.Parameter(distribute_tensor(whole.clone(), mesh, [Shard(0)]))
    model.router = torch.nn.Parameter(torch.ones(3))
    want = {"experts": torch.ones(4, 3), "router": torch.full((3,), 2.0)}
    model.router.grad = torch.full((3,), 2.0)
    if rank == 0:  # only rank 0's tokens reached the experts
        model.experts.grad = distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)], src_data_rank=None)  # no collective
    result = localize.grads(model, want, 1e-6, 1e-6, TfLayout(tp=2))
    return {"status": result.status.value, "detail": result.detail, "max_abs": result.max_abs}


@pytest.mark.slow
def test_a_gradient_only_some_ranks_hold_is_gathered_on_every_rank_and_missing_where_absent():
    with tempfile.TemporaryDirectory() as tmp:
        fork_ranks(_worker, (tmp,), 2, timeout=120)
        got = answers(tmp, 2)
    # Rank 0 gathers the rank-1 half as zeros: off by 1.0 there. Rank 1 has no gradient of its own.
    assert got[0]["status"] == "fail" and got[0]["max_abs"] == 1.0 and "experts max_abs 1.0e+00" in got[0]["detail"]
    assert got[1]["status"] == "fail" and "experts: gradient missing" in got[1]["detail"]
    assert "router" not in got[0]["detail"] + got[1]["detail"]
