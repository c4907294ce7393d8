"""A local world (`--local-world`) in this process: its group arithmetic, per-rank regions, limits and stand-in.

The world here is torch's fake process group with `LocalTensorMode`, as `paracheck run --local-world N` builds it;
the launched runs (every rank's checks on real diffusers models, against gloo) are in test_localworld_runs.py.
"""

import contextlib
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, strategies as st

from paracheck.domain.records import CaseStatus, Failure, FailureKind
from paracheck.results.report import local_line, local_share
from paracheck.world.localworld import LocalWorld, NoLocalRule, RankDependent, same_shape_group
from paracheck.world.regions import RegionError, each_rank, per_rank
from tests.strategies import layouts

DIMS = (("tp",), ("ring",), ("ulysses",), ("ring", "ulysses"), ("tp", "ulysses"), ("tp", "ring"))


@given(layouts(max_degree=4), st.sampled_from(DIMS), st.data())
def test_the_group_of_a_shape_holding_a_rank_is_the_layouts_group_of_that_rank(layout, dims, data):
    """The arithmetic a local world answers `dist.get_process_group_ranks` with, as rank R, is the kit's own
    layout math: rank 0's group along any mesh dimensions, moved to hold R, is R's group (torch's mesh arithmetic
    against `domain.layout`, which share no code)."""
    rank = data.draw(st.integers(0, layout.world - 1))
    assert same_shape_group(layout.group(0, dims), rank, layout.world) == tuple(layout.group(rank, dims))


def _verdict(status, exception=None):
    failure = Failure(FailureKind.SKIP, None, exception, "regions._same_shapes") if exception else None
    return SimpleNamespace(status=status, failure=failure)


def test_the_share_counts_a_local_worlds_limits_apart_from_other_skips_and_names_the_stand_in():
    verdicts = [_verdict(CaseStatus.PASS), _verdict(CaseStatus.XFAIL), _verdict(CaseStatus.SKIP, "NoLocalRule"),
                _verdict(CaseStatus.SKIP, "NoLocalRule"), _verdict(CaseStatus.SKIP, "KeyError"),
                _verdict(CaseStatus.SKIP)]
    share = local_share(verdicts, 8)
    assert (share["ranks"], share["cases"], share["ran"], share["one_process_limits"], share["other_skips"]) == (
        8, 6, 2, 2, 2)
    assert share["limits"] == {"NoLocalRule at regions._same_shapes": 2}
    assert [s["report"] for s in share["stood_in"]] == ["docs/upstream/localtensor_all_gather.md",
                                                        "docs/upstream/localtensor_fsdp_storage.md",
                                                        "docs/upstream/localtensor_generator.md"]
    line = local_line(share)
    assert "2 of 6 cases ran; 2 could not run" in line and "localtensor_all_gather.md" in line


@pytest.fixture
def world():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with LocalWorld(4) as world:
        yield world


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))


def test_all_gather_over_a_subgroup_gives_each_rank_its_own_groups_pieces(world):
    """The stood-in rule (docs/upstream/localtensor_all_gather.md): ranks 0, 1 gather [0, 1]; ranks 2, 3 [2, 3]."""
    from torch.distributed._local_tensor import LocalTensor

    group = _mesh().get_group("b")
    x = LocalTensor({r: torch.tensor([float(r)]) for r in world.ranks})
    with world.mode:
        out = [torch.empty_like(x) for _ in range(2)]
        dist.all_gather(out, x, group=group)
    assert {r: [o._local_tensors[r].item() for o in out] for r in world.ranks} == {
        0: [0.0, 1.0], 1: [0.0, 1.0], 2: [2.0, 3.0], 3: [2.0, 3.0]}


def test_torchs_own_all_gather_rule_is_still_wrong_so_the_stand_in_is_still_needed(capsys):
    """The upstream reproduction, run as is (no local world): when torch fixes its rule this fails, and the
    stand-in and its `LOCAL_WORLD_STOOD_IN` entry go."""
    import pathlib
    import runpy

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    runpy.run_path(str(pathlib.Path(__file__).parents[2] / "docs/upstream/localtensor_all_gather.py"))
    out = capsys.readouterr().out
    assert "rank 0: all_gather [2.0, 3.0], all_gather_into_tensor [0.0, 1.0]" in out, out


def test_a_draw_from_a_generator_gives_every_rank_what_one_process_draws_and_moves_it_once(world):
    """The stood-in rule (docs/upstream/localtensor_generator.md), factory and in-place draws alike; the generator
    then stands where one process's would, so the next draw matches too."""
    from torch.distributed._local_tensor import LocalTensor

    alone = torch.Generator().manual_seed(0)
    first, second, third = (torch.randn(3, generator=alone) for _ in range(3))
    shared = torch.Generator().manual_seed(0)
    with world.mode:
        x = torch.randn(3, generator=shared)
        y = torch.randn(3, generator=shared)
        z = LocalTensor({r: torch.zeros(3) for r in world.ranks}).normal_(generator=shared)
    for r in world.ranks:
        assert [torch.equal(t._local_tensors[r], e) for t, e in ((x, first), (y, second), (z, third))] == [True] * 3


def test_torchs_own_generator_rule_still_draws_on_from_rank_to_rank_so_the_stand_in_is_still_needed(capsys):
    """The upstream reproduction, run as is (no local world): when torch fixes its rule this fails, and the
    stand-in and its `LOCAL_WORLD_STOOD_IN` entry go."""
    import pathlib
    import runpy

    runpy.run_path(str(pathlib.Path(__file__).parents[2] / "docs/upstream/localtensor_generator.py"))
    out = capsys.readouterr().out
    assert "rank 1: [-2.1788, 0.5684]" in out and "expected, every rank: [1.541, -0.2934]" in out, out


def test_kit_code_run_once_per_rank_returns_its_one_value_and_refuses_a_value_that_differs(world):
    """`once_per_rank` (a control's planter that picks by its rank: the torch adapter's `torch-shard-swap`) hands
    back what every rank returned, and never rank 0's for all where they differ."""
    from paracheck.world.regions import once_per_rank

    with world.mode:
        assert once_per_rank(lambda: f"planted as {dist.get_world_size()}") == "planted as 4"
        with pytest.raises(RankDependent, match="another value on some ranks"):
            once_per_rank(lambda: dist.get_rank())
        with pytest.raises(TypeError, match="returned a tensor; it must return a plain value"):
            once_per_rank(lambda: torch.zeros(2))


def _chunk_mine(x, group):
    """A library's "my chunk" code: the rank's index in the group picks it."""
    return x.chunk(dist.get_world_size(group))[dist.get_rank(group)]


def test_a_per_rank_region_computes_each_ranks_chunk_and_its_gradient_exactly(world):
    from torch.distributed._local_tensor import LocalTensor

    group = _mesh().get_group("b")
    chunk = per_rank(_chunk_mine)
    base = torch.arange(8.0)
    x = LocalTensor({r: base + 10 * r for r in world.ranks}, requires_grad=True)
    with world.mode:
        y = chunk(x, group)
        (y * y).sum().backward()
    for r in world.ranks:
        mine = r % 2  # the rank's index in its "b" group
        assert torch.equal(y._local_tensors[r], (base + 10 * r).chunk(2)[mine])
        expected = torch.zeros(8)
        expected[4 * mine:4 * mine + 4] = 2 * (base + 10 * r)[4 * mine:4 * mine + 4]
        assert torch.equal(x.grad._local_tensors[r], expected)


def test_python_that_needs_one_value_of_a_per_rank_one_outside_a_region_raises_naming_it(world):
    mesh = _mesh()
    with world.mode, pytest.raises(RankDependent, match="differs between ranks"):
        int(mesh.get_local_rank("b"))


def test_a_region_whose_ranks_get_different_shapes_is_a_named_limit(world):
    from torch.distributed._local_tensor import LocalTensor

    uneven = per_rank(lambda x: x.tensor_split(4)[dist.get_rank()])
    x = LocalTensor({r: torch.arange(7.0) for r in world.ranks})
    with world.mode, pytest.raises(NoLocalRule, match=r"ranks \[0, 1, 2\]: \[2\]; ranks \[3\]: \[1\]"):
        uneven(x)


def test_a_region_that_gives_some_ranks_a_tensor_and_others_none_is_a_named_limit(world):
    """transformers' expert-parallel load: `shard_tensor` gives each rank its own expert and `None` for the others'
    (was an AttributeError on `None.shape`, an error where a local world's limit is meant)."""
    from torch.distributed._local_tensor import LocalTensor

    mine = per_rank(lambda x: x if dist.get_rank() == 0 else None)
    x = LocalTensor({r: torch.arange(4.0) for r in world.ranks})
    with world.mode, pytest.raises(RankDependent, match=r"ranks \[1, 2, 3\] another structure .*\[tensor\] "
                                                        r"against \[NoneType\]"):
        mine(x)


def test_ranks_that_diverge_in_a_region_end_it_naming_them(world):
    def body(rank):
        if rank == 3:
            return None
        return dist.all_reduce(torch.ones(1))

    with pytest.raises(RegionError, match=r"\[0, 1, 2\] wait in a collective .* ranks \[3\] finished without"):
        each_rank(body, world.ranks)


def test_a_rank_query_from_a_thread_of_the_librarys_own_raises_instead_of_answering_rank_0(world):
    """transformers loads weights in a pool of threads; where the mode is off (a region, or between passes) the
    fake group would answer rank 0 there for every rank: each rank silently held rank 0's TP shard (measured on
    llama tp2: forward 0.75 off). Such a query raises; with the mode on, the same thread's answer is per rank
    (the control)."""
    import threading

    mesh = _mesh()
    answers = []

    def loader():
        for query in (dist.get_rank, lambda: mesh.get_local_rank("b")):
            try:
                answers.append(query())
            except RankDependent as exc:
                answers.append(str(exc))

    for mode in (contextlib.nullcontext(), world.mode):
        with mode:
            thread = threading.Thread(target=loader, name="loader")
            thread.start()
            thread.join()
    assert "dist.get_rank in thread 'loader', not the local world's" in answers[0], answers
    assert "DeviceMesh.get_local_rank in thread 'loader'" in answers[1], answers
    assert [answers[2].node._local_ints, answers[3].node._local_ints] == [{0: 0, 1: 1, 2: 2, 3: 3},
                                                                        {0: 0, 1: 1, 2: 0, 3: 1}]


def test_fsdp_of_real_weights_raises_naming_its_chunk_pick_and_of_even_meta_weights_shards_each_rank(world):
    """FSDP2 picks this rank's chunk by the fake group's rank (0 for every rank): under the world that pick is a
    `RankDependent` naming torch's line, not rank 0's chunk everywhere. On meta (transformers shards there, then
    loads each rank's shard) an even split has nothing to pick from, and runs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (4,))
    with world.mode:
        with pytest.raises(RankDependent, match=r"_fsdp_param.py:\d+ \(_init_sharded_param\)"):
            fully_shard(torch.nn.Linear(4, 8), mesh=mesh)
        with torch.device("meta"):
            on_meta = torch.nn.Linear(4, 8)
        fully_shard(on_meta, mesh=mesh)
    assert on_meta.weight.to_local().shape == (2, 4)


def test_torchs_own_fsdp_storage_is_still_unresizable_so_the_stand_in_is_still_needed(capsys):
    """The upstream reproduction (docs/upstream/localtensor_fsdp_storage.md), run as is: when torch resizes a
    LocalTensor's storage this fails, and the stand-in and its `LOCAL_WORLD_STOOD_IN` entry go."""
    import pathlib
    import runpy

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    runpy.run_path(str(pathlib.Path(__file__).parents[2] / "docs/upstream/localtensor_fsdp_storage.py"))
    out = capsys.readouterr().out
    assert "forward 1 raised RuntimeError: Attempted to call resize_() on an invalid python storage" in out, out


def test_per_rank_inputs_join_each_ranks_tensors_and_refuse_a_non_tensor_that_differs(world):
    from torch.distributed._local_tensor import LocalTensor

    from paracheck.world.localworld import per_rank_tensors

    with world.mode:
        joined = per_rank_tensors(lambda rank: {"ids": torch.full((2,), rank), "rows": 2})
        assert isinstance(joined["ids"], LocalTensor) and joined["rows"] == 2
        assert [joined["ids"]._local_tensors[r][0].item() for r in world.ranks] == [0, 1, 2, 3]
        with pytest.raises(RankDependent, match=r"ranks \[1, 2, 3\]"):
            per_rank_tensors(lambda rank: {"ids": torch.zeros(2), "rows": rank})
