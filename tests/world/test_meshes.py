"""The world's mesh cache, in process on a one-rank gloo world: one mesh per key, and the safety net."""

import pytest
import torch.distributed as dist

from paracheck.world import meshes
from paracheck.adapters.diffusers.layout import DiffusersLayout


@pytest.fixture
def world(one_rank_world):
    return meshes.for_world()


def test_one_mesh_per_key_and_the_order_is_part_of_it(world):
    layout = DiffusersLayout(1, 1, 1)
    assert meshes.for_world() is world
    shared = world.shared(layout, "cpu")
    assert world.shared(layout, "cpu") is shared and world.shared(layout, "cpu", "cp-fastest") is shared
    swapped = world.shared(layout, "cpu", "tp-fastest")
    assert swapped is not shared and swapped.mesh_dim_names == ("ring", "ulysses", "tp")
    assert world.along(layout, ("ring", "ulysses"), "cpu").mesh_dim_names == ("ring", "ulysses")
    assert world.along(layout, ("tp",), "cpu") is world.along(layout, ("tp",), "cpu")
    assert len(world.built) == 4


def test_settle_keeps_what_new_meshes_made_and_destroys_any_other_new_group(world):
    before = meshes.group_names()
    world.fresh = True  # as after a case's first ask for a new mesh: its groups are the mesh's own
    adopted = dist.new_group([0])
    assert world.settle(before) == [] and adopted.group_name in world.held
    before = meshes.group_names()
    stray = dist.new_group([0])
    name = stray.group_name
    assert world.settle(before) == [name]
    assert name not in meshes.group_names() and adopted.group_name in meshes.group_names()


def test_a_new_world_starts_with_no_meshes(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    seen = []
    for attempt in range(2):
        store = dist.FileStore(str(tmp_path / f"store{attempt}"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            seen.append(meshes.for_world())
            seen[-1].along(DiffusersLayout(1, 1, 1), ("tp",), "cpu")
        finally:
            dist.destroy_process_group()
    assert seen[0] is not seen[1] and len(seen[1].built) == 1


def test_meshes_from_groups_share_one_group_per_rank_set(world):
    """transformers' dense and expert meshes, as `from_groups` makes them: one per key, and no new group where
    every dimension spans a rank set there already is a group for (here, the one-rank world's default group)."""
    before = meshes.group_names()
    dense = world.from_groups(meshes.MeshKey("cpu", (1, 1, 1, 1), ("pp", "dp_replicate", "fsdp", "tp")))
    expert = world.from_groups(meshes.MeshKey("cpu", (1, 1, 1, 1), ("pp", "dp_replicate", "efsdp", "ep")))
    assert world.from_groups(meshes.MeshKey("cpu", (1, 1, 1, 1), ("pp", "dp_replicate", "fsdp", "tp"))) is dense
    assert dense is not expert and expert["ep"].get_group() is dense["tp"].get_group() is world.world
    assert meshes.group_names() == before and world.settle(before) == []


def test_a_mesh_key_names_one_size_per_dimension():
    with pytest.raises(ValueError, match=r"mesh shape \(2, 2\) and dims \('tp',\): must have one size"):
        meshes.MeshKey("cpu", (2, 2), ("tp",))
