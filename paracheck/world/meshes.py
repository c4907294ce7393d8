"""Device meshes of one world: one mesh, and so one set of process groups, per distinct mesh, reused by every case.

torch keeps every process group until it is destroyed, and on gloo each holds threads (two run loops and
a TCP loop per group). A mesh per case therefore grew each rank by a few threads per case, thousands over a
`--controls` run. `Meshes` owns `layout -> mesh`: every route asks it, and it builds a mesh the first time a
(device type, shape, dimension names in order) is asked for. The library is handed these meshes (`mesh=` of
its CP and TP configs), so its own setup (the CP config's flattened ring x ulysses mesh, cached by torch on
the root mesh) adds groups only the first time too.

A library that builds its meshes from a mesh's shape alone (transformers' `initialize_distributed_mesh`) is
handed meshes made by `from_groups`: one process group per distinct set of ranks, shared by every mesh that
has a dimension over that set (`DeviceMesh.from_group`), so a 4-rank world holds the same few groups whatever
the shapes asked for.

After each case `settle` compares the process groups with those before it: groups the case's first use of a
new mesh made are held with the mesh; any other new group belongs to nobody, and is destroyed (the safety net
for a library that builds a mesh of its own). Destroying is local to a rank, never a collective, so ranks that
disagree about it cannot hang the world.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from paracheck.domain.layout import Layout
from paracheck.world import recent


@dataclass(frozen=True)
class MeshKey:
    """What makes two meshes the same: device type, shape, and dimension names in order (the order is part
    of the key, so a control that swaps it gets a mesh of its own)."""
    device_type: str
    shape: tuple[int, ...]
    dims: tuple[str, ...]

    def __post_init__(self):
        if len(self.shape) != len(self.dims):
            raise ValueError(f"mesh shape {self.shape} and dims {self.dims}: must have one size per dimension name")


@dataclass
class Meshes:
    """The meshes of one world (one default process group), each built once."""
    world: object
    built: dict[MeshKey, object] = field(default_factory=dict)
    #: Names of the process groups the built meshes hold (the library's flattened meshes included).
    held: set[str] = field(default_factory=set)
    #: A mesh was built since the last `settle`: groups new since then are its own.
    fresh: bool = False
    #: ranks (sorted) -> this rank's process group over them (None where this rank is not one of them).
    groups: dict[tuple[int, ...], object] = field(default_factory=dict)

    def mesh(self, key: MeshKey):
        if key not in self.built:
            from torch.distributed.device_mesh import init_device_mesh

            self.built[key] = init_device_mesh(key.device_type, key.shape, mesh_dim_names=key.dims)
            self.fresh = True
        return self.built[key]

    def from_groups(self, key: MeshKey):
        """The mesh of `key` over the world's shared groups: one per distinct rank set, made on first ask. In a
        local world (`world.localworld`) torch's own mesh: its groups are fake and hold no threads, and picking
        this rank's group by `dist.get_rank()` would need one value of a per-rank one."""
        if _in_local_world():
            return self.mesh(key)
        if key not in self.built:
            from torch.distributed.device_mesh import DeviceMesh

            ranks = torch.arange(dist.get_world_size()).reshape(key.shape)
            dims = [self._group_along(ranks, d) for d in range(len(key.shape))]
            self.built[key] = DeviceMesh.from_group(dims, key.device_type, mesh=ranks, mesh_dim_names=key.dims)
            self.fresh = True  # what the library derives from it in this case (flattened meshes) is its own
        return self.built[key]

    def _group_along(self, ranks, dim: int):
        """This rank's group along dimension `dim` of the rank grid; makes the groups of that dimension that do
        not exist yet. Every rank makes them in the same order (`new_group` is collective over the world)."""
        mine = None
        for members in ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim]).tolist():
            members = tuple(sorted(members))
            if members not in self.groups:
                self.groups[members] = self._new_group(members)
            if dist.get_rank() in members:
                mine = self.groups[members]
        return mine

    def _new_group(self, members: tuple[int, ...]):
        if len(members) == dist.get_world_size():
            return self.world  # the whole world: the default group, as torch's own meshes reuse it
        group = dist.new_group(list(members), group_desc=f"paracheck_{'_'.join(map(str, members))}")
        if dist.get_rank() in members:
            self.held.add(group.group_name)
            return group
        return None

    def shared(self, layout: Layout, device_type: str, order: str | None = None):
        """The one mesh of `layout` (its mesh dimensions and shape), in mesh order `order` (the layout's own unless a
        control bends it)."""
        shaped = layout.with_order(order)
        return self.mesh(MeshKey(device_type, shaped.mesh_shape, shaped.mesh_dims))

    def along(self, layout: Layout, dims: tuple[str, ...], device_type: str):
        """The mesh over `layout`'s dimensions `dims` alone, in that order (what a library builds for one kind of
        parallelism's config, e.g. diffusers' ("ring", "ulysses") for context parallelism)."""
        return self.mesh(MeshKey(device_type, tuple(layout.degree(d) for d in dims), tuple(dims)))

    def settle(self, before: set[str]) -> list[str]:
        """End a case that started with process groups `before`: keep what new meshes hold, destroy any other
        group the case made; returns the names destroyed."""
        new = group_names() - before - self.held
        if self.fresh:
            self.held |= new
            self.fresh, new = False, set()
        for group, name in list(_groups().items()):
            if name in new:
                dist.destroy_process_group(group)
        if new:
            _forget_destroyed_meshes()
        return sorted(new)


_current: Meshes | None = None


def _in_local_world() -> bool:
    """Whether this process runs every rank of a local world now (torch's `LocalTensorMode` is enabled)."""
    from torch.distributed._local_tensor import enabled_local_tensor_mode

    return enabled_local_tensor_mode() is not None


def for_world() -> Meshes:
    """This process's meshes for the world it is in now (a new world, after the default group was destroyed
    and made again, starts with none, and with nothing kept: `recent.enter`)."""
    global _current
    world = dist.distributed_c10d._get_default_group()
    if _current is None or _current.world is not world:
        _current = Meshes(world)
        recent.enter(world)  # what the last world kept goes with it (`world.recent`)
    return _current


def _forget_destroyed_meshes() -> None:
    """Empty DTensor's sharding propagation caches. They key on meshes by equality and keep the output specs of
    the first call, whose mesh names that call's groups: after those groups are destroyed, a later equal mesh
    would be handed specs that name them ("Could not resolve the process group registered under the name")."""
    from torch.distributed.tensor import debug

    clear = getattr(debug, "_clear_sharding_prop_cache", None)  # torch's own helper (debug module)
    if clear is not None:
        clear()


def group_names() -> set[str]:
    """Names of every process group this rank holds, the default group included."""
    return set(_groups().values())


def _groups() -> dict:
    # torch lists a process's groups only in its private world registry (group -> name).
    return dict(dist.distributed_c10d._world.pg_names)
