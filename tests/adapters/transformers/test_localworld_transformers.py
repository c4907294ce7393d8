"""The transformers adapter in a local world (`--local-world`): `from_pretrained(distributed_config=...)` for
every rank in one process, held to the same checks as on gloo.

Run in this process as `run_local_case` runs a case. Without the per-rank rules (`library.PER_RANK`: transformers'
`shard_tensor` slices by this rank's coordinate; its loader's thread pool, where the mode is off) every rank
silently held rank 0's shards: forward 0.75 off on tp2.
"""

import os

import pytest
import torch.distributed as dist


@pytest.mark.slow  # no launch, but three cases' loads and compute (32 s of CPU; 207 s wall at load 30-45)
def test_llama_on_tp2_fsdp2_and_dpr2_in_one_process_passes_every_check_on_both_ranks(tmp_path):
    """dpr2: FSDP2's shard dimension there has one rank, whose rank under the mode is a constant (it raised
    AttributeError: 'ConstantIntNode' object has no attribute 'int_' before)."""
    from paracheck.adapters.transformers import cases as tf_cases
    from paracheck.adapters.transformers.layout import TfLayout
    from paracheck.domain.backends import get_backend
    from paracheck.domain.case import Case
    from paracheck.domain.records import CheckId, RankStatus, Status
    from paracheck.rank.localrun import run_local_case
    from paracheck.world.localworld import LocalWorld

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    os.makedirs(tmp_path / "refs")
    found = {}
    with LocalWorld(2) as world:
        for index, layout in enumerate((TfLayout(tp=2), TfLayout(fsdp=2), TfLayout(dpr=2))):
            case = Case("llama", tf_cases.factory_of("llama"), layout, library="transformers")
            found[layout.name] = run_local_case(index, case, get_backend("gloo"), world, str(tmp_path / "refs"),
                                                str(tmp_path / f"case{index}"))
    for name, results in found.items():
        assert [r.rank for r in results] == [0, 1]
        for result in results:
            assert result.status == RankStatus.OK, (name, result.rank, result.reason)
            checks = {c.id: c for c in result.checks}
            for check in (CheckId.MESH, CheckId.FORWARD, CheckId.INFERENCE, CheckId.LOSS, CheckId.GRADS):
                assert checks[check].status == Status.PASS, (name, result.rank, checks[check])
            assert checks[CheckId.FORWARD].max_abs < 1e-6  # fp32 on CPU, as on gloo (2.4e-7 measured on tp2)


def test_expert_parallelism_is_a_named_local_world_limit_before_anything_is_built(tmp_path):
    """qwen3_moe with EP in one process: `fsdp4xep4` raised inside the load (each rank's experts, `None` for the
    others'), `tp4xep4` at a rank-0-only warning; under gradients `AllToAllEP`'s ranks receive routing-dependent
    token counts. So the adapter says so before the case builds (no reference, no load): every rank a skip in a
    local world's words, counted by the share as a one-process limit; a dense layout of the same model is not."""
    from paracheck.adapters.transformers import cases as tf_cases
    from paracheck.adapters.transformers.layout import TfLayout
    from paracheck.domain import registry
    from paracheck.domain.backends import get_backend
    from paracheck.domain.case import Case
    from paracheck.domain.records import LOCAL_WORLD_SKIP, RankStatus
    from paracheck.rank.localrun import run_local_case
    from paracheck.world.localworld import limit

    factory = tf_cases.factory_of("qwen3_moe")
    adapter = registry.adapter("transformers")
    assert adapter.local_limit(Case("qwen3_moe", factory, TfLayout(tp=4), library="transformers")) is None
    case = Case("qwen3_moe", factory, TfLayout(fsdp=4, ep=4), library="transformers")
    world = type("World", (), {"ranks": [0, 1, 2, 3]})()  # nothing of the world is reached before the limit
    results = run_local_case(0, case, get_backend("gloo"), world, str(tmp_path), str(tmp_path / "case"))
    assert [r.rank for r in results] == [0, 1, 2, 3]
    for result in results:
        assert result.status == RankStatus.SKIP and result.reason.startswith(LOCAL_WORLD_SKIP)
        assert "expert_parallel.py:225" in result.reason and limit(result.failure.exception)
    assert not os.listdir(tmp_path)  # nothing built: no case folder, no reference


def test_a_plan_rule_that_matches_nothing_is_warned_of_per_rank_not_a_rank_dependent_skip():
    """transformers warns of unused plan rules on rank 0 only (`mixin.py:206`), which in one process is a comparison
    that differs between ranks: qwen3_moe tp4 (its plan names rules for experts it does not have there) was a skip.
    Run per rank (`library.PER_RANK`) it passes; outside the regions it still raises (the control)."""
    from transformers.distributed.mixin import DistributedMixin
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    from paracheck.adapters.transformers.library import per_rank_regions
    from paracheck.world.localworld import LocalWorld, RankDependent

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    plan = {"layers.*.mlp.experts": "colwise"}
    with LocalWorld(4) as world:
        with world.mode, pytest.raises(RankDependent, match="mixin.py"):
            DistributedMixin._validate_parallel_plan(object(), plan, ALL_PARALLEL_STYLES, "tp_plan", {"lm_head"})
        with per_rank_regions(), world.mode:
            DistributedMixin._validate_parallel_plan(object(), plan, ALL_PARALLEL_STYLES, "tp_plan", {"lm_head"})


def test_the_router_control_pushes_each_ranks_own_expert_share_in_one_process():
    """`tf-router-topk-on-shard` picks this rank's share of the experts by its rank: a Python index raised
    RankDependent at its mask in a local world (qwen3_moe tp4: a skip where gloo detects it). Each rank's mask is
    now its own tensor (`per_rank_tensors`): on tp4 rank r's top-1 is expert r; unplanted, every rank's is the same."""
    from types import SimpleNamespace

    import torch

    from paracheck.adapters.transformers.controls import _topk_on_shard
    from paracheck.adapters.transformers.layout import TfLayout
    from paracheck.world.localworld import LocalWorld

    class Router(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.eye(4) * torch.tensor([4.0, 3.0, 2.0, 1.0]))

        def forward(self, x):
            return torch.topk(torch.nn.functional.linear(x, self.weight), 1).indices

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    plain, planted = torch.nn.Sequential(Router()), torch.nn.Sequential(Router())
    planted.config = SimpleNamespace(num_experts=4)
    _topk_on_shard(planted, TfLayout(tp=4))
    with LocalWorld(4) as world, world.mode:
        ours, theirs = planted(torch.ones(1, 4)), plain(torch.ones(1, 4))
    assert [int(ours._local_tensors[r]) for r in world.ranks] == [0, 1, 2, 3]
    assert [int(theirs._local_tensors[r]) for r in world.ranks] == [0, 0, 0, 0]


def test_a_control_planted_once_per_rank_runs_its_after_load_as_each_rank_in_one_process():
    """`Control.per_rank` was honoured by the torch and diffusers adapters only: a transformers `after_load` that
    picks by its rank ran once for every rank in a local world. Now it runs once per rank, each acting as its rank,
    and returns the one value they agree on; a control that does not ask runs it once."""
    from paracheck.adapters.transformers.body import after_load
    from paracheck.adapters.transformers.controls import Plant
    from paracheck.domain.control import Control
    from paracheck.domain.records import CheckId
    from paracheck.world.localworld import LocalWorld

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    seen = []
    plant = Plant(after_load=lambda model, layout: seen.append(dist.get_rank()) or "model.layers.0")
    control = Control("tf-toy", "toy", (CheckId.FORWARD,), lambda layout: None, per_rank=True)
    with LocalWorld(3) as world, world.mode:
        assert after_load(control, plant, None, None) == "model.layers.0"
        assert seen == [0, 1, 2]
        after_load(Control("tf-toy", "toy", (CheckId.FORWARD,), lambda layout: None), plant, None, None)
    assert len(seen) == 4 and not isinstance(seen[3], int)  # once, with every rank's rank in one value


def test_the_vision_language_controls_plant_each_ranks_own_share_in_one_process(monkeypatch):
    """`tf-vlm-tower-partial` and `tf-vlm-placeholders-on-shard` sliced their share by the tp coordinate, one Python
    value under the mode: `RankDependent` at `_share` in a local world (llava-image-text tp2: a skip where gloo
    detects it). Each share is now a per-rank mask: in one process rank r's placeholder mask is the whole one on its
    share of an odd row (3 and 2 tokens), and its tower output the partial sum of its rows, as on gloo."""
    import copy

    import torch

    from paracheck.adapters.transformers import controls
    from paracheck.world.localworld import LocalWorld
    from tests.adapters.transformers.test_tf_control_rules import _tiny_llava

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    vlm, tower = copy.deepcopy(_tiny_llava(2, -2)), copy.deepcopy(_tiny_llava(2, -2))  # one build
    ids, x = torch.tensor([[63, 1, 63, 63, 1]]), torch.randn(2, 5, 24)
    monkeypatch.setattr(controls, "_tp_coordinate", lambda model: (dist.get_rank(), 2))  # per rank under the mode
    with LocalWorld(2) as world, world.mode:
        controls._placeholders_on_shard(vlm, None)
        controls._tower_left_partial(tower, None)
        mask = vlm.model.get_placeholder_mask(ids, torch.zeros(1, 5, 16), torch.zeros(3, 16))
        fc2 = tower.model.vision_tower.encoder.layers[0].mlp.fc2
        with torch.no_grad():
            out = fc2(x)
    assert [mask._local_tensors[r][0, :, 0].tolist() for r in world.ranks] == [[True, False, True, False, False],
                                                                              [False, False, False, True, False]]
    for r, rows in ((0, slice(0, 12)), (1, slice(12, 24))):
        alone = torch.nn.functional.linear(x[..., rows], fc2.weight[:, rows], fc2.bias).detach()
        assert torch.allclose(out._local_tensors[r], alone, atol=1e-6)


def test_the_expert_parallel_limit_is_still_upstreams():
    """`library.EP_LOCAL_LIMIT` (every `ep` layout a skip in a local world) stands for two things in the installed
    transformers; this fails, saying to drop the limit, the day either is gone. (1) A rank loads only its own
    experts: `shard_tensor` answers None for another rank's expert and `WeightConverter.materialize_tensors` drops
    the Nones (core_model_loading.py), a list whose length differs between ranks. (2) `AllToAllEP._dispatch_tokens`
    reads its routing-dependent split sizes back to the host (`.tolist()`, expert_parallel.py), shapes that differ
    between ranks."""
    import inspect
    from types import SimpleNamespace

    import torch
    from torch.distributed.tensor import Shard
    from transformers.core_model_loading import WeightConverter
    from transformers.distributed.expert_parallel import AllToAllEP
    from transformers.distributed.sharding_utils import DtensorShardOperation

    drop = "transformers changed: drop or narrow EP_LOCAL_LIMIT (transformers/library.py) and run ep in a local world"
    shard = DtensorShardOperation.__new__(DtensorShardOperation)  # rank 1 of ep2: experts 2 and 3 of 4
    shard.placements, shard.param_ndim = (Shard(0),), 3
    shard._axis0_offset, shard._axis0_local_size, shard._axis0_size = 2, 2, 4
    expert = torch.ones(3, 5)
    mine = [shard.shard_tensor(expert, tensor_idx=i) for i in range(4)]
    assert [m is None for m in mine] == [True, True, False, False], drop
    held = SimpleNamespace(collected_tensors={"experts": [lambda m=m: m for m in mine]})
    assert len(WeightConverter.materialize_tensors(held)["experts"]) == 2, drop
    assert ".tolist()" in inspect.getsource(AllToAllEP._dispatch_tokens), drop
