"""One process as every rank of an N-rank world: torch's fake process group, `LocalTensorMode`, and "as rank R".

Under torch's `LocalTensorMode` a tensor holds every rank's value and collectives compute exactly on them, so a
model whose Python is the same on every rank (SPMD) runs once for the whole world. Python that is not the same on
every rank cannot: under the fake group `dist.get_rank()` is 0, so code that picks "my chunk" with it would
silently compute rank 0's everywhere. This module makes such code loud or exact:

- `rank_as(r)`: inside it (per thread), this process is rank `r`: `dist.get_rank`, `dist.get_process_group_ranks`
  (the group of the same shape that holds `r`), the device mesh's coordinates, and every per-rank integer torch
  hands out under the mode (`LocalIntNode`) answer as rank `r`.
- Outside `rank_as`, while the mode is on, `dist.get_rank()` is the per-rank integer torch's meshes give
  (`DeviceMesh.get_rank` under the mode), and a per-rank integer that differs between ranks raises
  `RankDependent` where Python needs one value of it (an index, a branch), naming the line. What raises there is
  run per rank (`regions`) or reported as a skip; nothing takes rank 0's value for every rank.

Three of torch's own are stood in for: `dist.all_gather` (the list form) over a subgroup, whose torch 2.13 rule
hands every rank the last group's tensors (`_all_gather_list`, docs/upstream/localtensor_all_gather.md),
FSDP2's storage resizing, which a `LocalTensor` has no storage for (`_each_rank_storage`,
docs/upstream/localtensor_fsdp_storage.md), and a draw from an explicit `torch.Generator`, which torch hands each
rank from where the rank before left it (`_same_draw_each_rank`, docs/upstream/localtensor_generator.md).

The patches are installed for the life of a `LocalWorld` and removed on exit, also on error.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import traceback

import torch
import torch.distributed as dist

from paracheck.domain.records import LOCAL_WORLD_LIMITS


class RankDependent(RuntimeError):
    """Python needed one value of something that differs between ranks, outside a per-rank region."""


class NoLocalRule(RuntimeError):
    """`LocalTensorMode` has no rule for an operation (a collective or op kind it does not simulate)."""


def limit(exception: str) -> bool:
    """Whether an exception (by class name, as `records.Failure` keeps it) is a local world's limit, not the case's."""
    return exception in LOCAL_WORLD_LIMITS


_state = threading.local()
#: The thread that entered the live local world (None without one): the one thread whose rank-free queries
#: answer as this process (rank 0) or, under the mode, per rank.
_home: list = [None]


def current_rank() -> int | None:
    """The rank this thread acts as (`rank_as`), or None."""
    return getattr(_state, "rank", None)


@contextlib.contextmanager
def rank_as(rank: int):
    """This thread acts as `rank` inside the block (see the module docstring)."""
    before = current_rank()
    _state.rank = rank
    try:
        yield
    finally:
        _state.rank = before


def mesh_coordinate(mesh, rank: int) -> list[int] | None:
    """`rank`'s coordinate on `mesh` (built by this process as rank 0): the submesh of the same dimensions that
    holds `rank`, as torch's own meshes answer under `LocalTensorMode`; None when no such submesh holds it."""
    grid = mesh._layout.remap_to_tensor(mesh._rank_map.clone())
    found = (grid == rank).nonzero().tolist()
    return found[0][1:] if len(found) == 1 else None


def group_members(group, rank: int) -> list[int]:
    """The ranks of the process group shaped like `group` (this process's, rank 0's) that holds `rank`, in order."""
    with rank_as(None):  # the group's ranks as this process (rank 0) holds them
        members = dist.get_process_group_ranks(group)
    return list(same_shape_group(members, rank, dist.get_world_size()))


def same_shape_group(members, rank: int, world: int) -> tuple[int, ...]:
    """The group of the same shape as `members` (a regular grid of ranks, as a mesh dimension makes) that holds
    `rank`, out of a world of `world` ranks: the arithmetic `LocalTensorMode` computes every group's collective with."""
    from torch.distributed._local_tensor._c10d import _indices_to_layout
    from torch.distributed._mesh_layout import _FlatLayout

    ordered = sorted(members)
    relative = [m - ordered[0] for m in ordered]
    offsets = _FlatLayout(*_indices_to_layout(relative)).complement(world).all_ranks_from_zero()
    for offset in offsets:
        group = tuple(offset + r for r in relative)
        if rank in group:
            return group
    raise RankDependent(f"rank {rank} is in no group shaped like {tuple(ordered)} in a world of {world}")


#: torch's own machinery between a per-rank value and the line that needed it: not the line to name.
_MACHINERY = ("/torch/fx/", "/torch/__init__.py", "/torch/distributed/_local_tensor/", "/torch/utils/")


def _caller() -> str:
    """Where a per-rank value was needed as one: the first frame outside torch (the caller's line), and, where
    the need is inside torch (FSDP2's mesh info, DTensor), the innermost line of torch that needed it."""
    stack = [f for f in traceback.extract_stack()[:-2] if f.filename != __file__]
    outer = next((f for f in reversed(stack) if "/torch/" not in f.filename), None)
    inner = next((f for f in reversed(stack) if not any(m in f.filename for m in _MACHINERY)), None)
    where = [f"{f.filename}:{f.lineno} ({f.name})" for f in (outer, inner) if f is not None]
    if len(where) == 2 and where[0] != where[1]:
        return f"{where[0]}, in {where[1]}"
    return where[0] if where else "?"


def _one(node, name: str):
    """The value of per-rank integer `node` for the rank this thread acts as; outside `rank_as` the value all
    ranks share, else `RankDependent`."""
    values = node._local_ints
    rank = current_rank()
    if rank is not None:
        return values[rank]
    if len(set(values.values())) == 1:
        return next(iter(values.values()))
    raise RankDependent(f"{name} of a value that differs between ranks ({_short(values)}) at {_caller()}: "
                        "Python that is not the same on every rank cannot run once for all of them")


def _short(values: dict) -> str:
    items = sorted(values.items())
    text = ", ".join(f"rank {r}: {v}" for r, v in items[:4])
    return text + (", ..." if len(items) > 4 else "")


def _compare(op):
    def method(self, other):
        from torch.distributed._local_tensor import _int_on_rank

        rank = current_rank()
        if rank is not None:
            return torch._C._get_constant_bool_symnode(op(self._local_ints[rank], _int_on_rank(other, rank)))
        results = {op(v, _int_on_rank(other, r)) for r, v in self._local_ints.items()}
        if len(results) != 1:
            raise RankDependent(f"a comparison whose answer differs between ranks ({_short(self._local_ints)}) at "
                                f"{_caller()}")
        return torch._C._get_constant_bool_symnode(results.pop())
    return method


def _all_gather_list(output_tensors, input_tensors, process_group_so, async_op=True, timeout=-1):
    """`dist.all_gather` (the list form) under `LocalTensorMode`, each group's gather written to that group's ranks
    only. torch's own (`_local_tensor._c10d._local_all_gather_`, 2.13 to 2.15) copies each group's pieces into
    every rank's outputs, so over a subgroup every rank ends with the last group's
    (docs/upstream/localtensor_all_gather.md)."""
    from torch._C._distributed_c10d import FakeWork
    from torch.distributed._local_tensor import LocalTensor, _c10d
    from torch.distributed.distributed_c10d import Work

    (outputs,), (source,) = output_tensors, input_tensors
    # (the group's ranks less its first, the first rank of each group like it): torch 2.13 also returns that first
    # rank, 2.15 does not
    ranks, offsets = _c10d._prepare_collective_groups(process_group_so)[:2]
    for offset in offsets:
        members = [offset + r for r in ranks]
        for i, sender in enumerate(members):
            piece = source._local_tensors[sender] if isinstance(source, LocalTensor) else source
            for receiver in members:
                outputs[i]._local_tensors[receiver].copy_(piece)
    return ([outputs], Work.boxed(FakeWork()))


def _each_rank_storage(resize):
    """FSDP2's `alloc_storage`/`free_storage` (`resize`), applied to every rank's tensor of a `LocalTensor`: a wrapper
    subclass has no storage of its own to resize ("Attempted to call resize_() on an invalid python storage")."""
    from torch.distributed._local_tensor import LocalTensor

    @functools.wraps(resize)
    def each(tensor) -> None:
        for local in (tensor._local_tensors.values() if isinstance(tensor, LocalTensor) else (tensor,)):
            resize(local)
    return each


def _same_draw_each_rank(run_each):
    """torch's `_for_each_rank_run_func` (`run_each`), where an op draws from an explicit `torch.Generator`: every
    rank draws from the generator as it stood before the op, as N processes each draw from their own generator,
    seeded alike, and the generator ends where one rank's draw leaves it. torch's own (2.13) runs the op rank after
    rank on the one shared generator, so rank r gets the (r+1)-th draw: a pipeline's initial noise (`randn_tensor`
    with `generator=`) differed on every rank (docs/upstream/localtensor_generator.md)."""
    from torch.distributed._local_tensor import _combine_rank_results, _is_inplace_op, _map_to_rank_local_val

    @functools.wraps(run_each)
    def run(func, ranks, args, kwargs, **options):
        generators = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Generator)]
        if not generators:
            return run_each(func, ranks, args, kwargs, **options)
        before = [g.get_state() for g in generators]
        outs, after = {}, {}
        for rank in sorted(ranks):  # one rank at a time, each from the same state
            for generator, state in zip(generators, before):
                generator.set_state(state)
            outs[rank] = run_each(func, frozenset({rank}), args, kwargs, **options)
            after[rank] = [g.get_state() for g in generators]
        if any(any(not torch.equal(a, b) for a, b in zip(s, after[min(ranks)])) for s in after.values()):
            raise RankDependent(f"{func}: ranks drew different amounts from one torch.Generator at {_caller()}: "
                                "one generator cannot stand for each rank's")
        if _is_inplace_op(func):
            return outs[min(ranks)]  # the LocalTensor written, every rank's part by its own call
        return _combine_rank_results({r: torch.utils._pytree.tree_map(lambda v: _map_to_rank_local_val(v, r),
                                                                      outs[r]) for r in ranks}, None)
    return run


def _install_fsdp_storage(patches: "_Patches") -> None:
    """FSDP2 frees and allocates its unsharded parameters' storage around each use; stood in for by rank
    (`_each_rank_storage`), in both modules that hold the functions by name."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    for name in ("alloc_storage", "free_storage"):
        stand_in = _each_rank_storage(getattr(_fsdp_param, name))
        for module in (_fsdp_param, _fsdp_param_group):
            if hasattr(module, name):
                patches.set(module, name, stand_in)


def _install_fsdp_rank(patches: "_Patches") -> None:
    """FSDP2 picks this rank's chunk of each parameter by `shard_process_group.rank()` (`FSDPMeshInfo`), which the
    fake group answers 0 for every rank, so every rank would silently hold rank 0's chunk. Under the mode it is
    made per rank, so the chunk's pick raises `RankDependent` naming FSDP2's line (`_init_sharded_param`), except
    for a meta parameter split evenly (a library that shards on meta, then loads each rank's shard itself, as
    transformers does): its chunks differ in nothing but the values it does not have, so rank 0's is every rank's."""
    from torch.distributed.fsdp._fully_shard import _fsdp_common, _fsdp_param
    from torch.distributed._local_tensor import enabled_local_tensor_mode

    info_init = _fsdp_common.FSDPMeshInfo.__dict__["__post_init__"]
    sharded = _fsdp_param.FSDPParam.__dict__["_init_sharded_param"]
    post_forward = _fsdp_param.FSDPParam.__dict__["_init_sharded_post_forward_param_metadata"]

    def post_init(self) -> None:
        info_init(self)
        # a dimension of one rank: 0 is every rank's
        if enabled_local_tensor_mode() is not None and current_rank() is None and self.shard_mesh_size > 1:
            self.shard_mesh_rank = self.mesh.get_local_rank(self.shard_mesh_dim)

    def even(param, mesh_info) -> bool:
        local = getattr(param, "_local_tensor", param)
        return local.ndim > 0 and local.shape[0] % getattr(mesh_info, "shard_mesh_size", 1) == 0

    def init_sharded(self, param, device, shard_placement_fn, mesh_info):
        mode = enabled_local_tensor_mode()
        if mode is not None and current_rank() is None and getattr(param, "_local_tensor", param).is_meta \
                and shard_placement_fn is None and even(param, mesh_info):
            with rank_as(min(mode.ranks)):
                return sharded(self, param, device, shard_placement_fn, mesh_info)
        return sharded(self, param, device, shard_placement_fn, mesh_info)

    def post_forward_size(self, param) -> None:
        # a size alone, the same for every rank where the split is even
        mode = enabled_local_tensor_mode()
        if mode is not None and current_rank() is None and even(param, self.post_forward_mesh_info):
            with rank_as(min(mode.ranks)):
                return post_forward(self, param)
        return post_forward(self, param)

    patches.set(_fsdp_common.FSDPMeshInfo, "__post_init__", post_init)
    patches.set(_fsdp_param.FSDPParam, "_init_sharded_param", init_sharded)
    patches.set(_fsdp_param.FSDPParam, "_init_sharded_post_forward_param_metadata", post_forward_size)


class _Patches:
    """What a local world changes in torch while it lives, restored in reverse on `close`."""

    def __init__(self):
        self._undo: list = []

    def set(self, owner, name: str, value) -> None:
        self._undo.append((owner, name, owner.__dict__.get(name, _MISSING) if isinstance(owner, type)
                           else getattr(owner, name, _MISSING)))
        setattr(owner, name, value)

    def close(self) -> None:
        while self._undo:
            owner, name, value = self._undo.pop()
            if value is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


_MISSING = object()


def _install(patches: _Patches) -> None:
    """Every patch a local world holds, in the order they are undone backwards (`_Patches.close`)."""
    _install_mode(patches)
    _install_fsdp_storage(patches)
    _install_fsdp_rank(patches)
    _install_mesh(patches)
    _install_ranks(patches)
    _install_int_nodes(patches)


def _install_mode(patches: _Patches) -> None:
    """LocalTensorMode's: an op it has no rule for raised typed (`NoLocalRule`), the list all-gather's stand-in, and
    each rank's own draw from an explicit generator."""
    from torch.distributed._local_tensor import LocalTensorMode

    dispatch = LocalTensorMode.__dict__["__torch_dispatch__"]

    @functools.wraps(dispatch)
    def typed_dispatch(self, func, types, args=(), kwargs=None):
        try:
            return dispatch(self, func, types, args, kwargs)
        except NotImplementedError as exc:
            raise NoLocalRule(f"LocalTensorMode has no rule for {func}: {exc}") from exc
    patches.set(LocalTensorMode, "__torch_dispatch__", typed_dispatch)
    from torch.distributed._local_tensor import _c10d

    patches.set(_c10d, "_local_all_gather_", _all_gather_list)
    import torch.distributed._local_tensor as local_tensor

    patches.set(local_tensor, "_for_each_rank_run_func", _same_draw_each_rank(local_tensor._for_each_rank_run_func))


def _install_mesh(patches: _Patches) -> None:
    """DeviceMesh's rank questions answered as the rank a thread acts as (`rank_as`); elsewhere the original."""
    from torch.distributed import DeviceMesh

    def mesh_method(name, as_rank):
        original = DeviceMesh.__dict__[name]

        @functools.wraps(original)
        def method(self, *args, **kwargs):
            rank = current_rank()
            if rank is None:
                _not_elsewhere(f"DeviceMesh.{name}")
                return original(self, *args, **kwargs)
            return as_rank(self, rank, *args, **kwargs)
        patches.set(DeviceMesh, name, method)

    def local_rank(mesh, rank, mesh_dim=None):
        index = mesh._mesh_dim_names.index(mesh_dim) if isinstance(mesh_dim, str) else (mesh_dim or 0)
        return mesh_coordinate(mesh, rank)[index]

    # Beneath LocalTensorMode's own patches of the same methods: the mode's win while it is enabled, these
    # answer while a per-rank region has it disabled.
    mesh_method("get_coordinate", mesh_coordinate)
    mesh_method("get_local_rank", local_rank)
    mesh_method("get_rank", lambda mesh, rank: rank)
    mesh_method("_is_current_rank_part_of_mesh", lambda mesh, rank: mesh_coordinate(mesh, rank) is not None)
    mesh_method("_sym_get_coordinate", lambda mesh, rank, index: mesh_coordinate(mesh, rank)[index])


def _install_ranks(patches: _Patches) -> None:
    """`dist.get_rank` and `get_process_group_ranks`: the acting rank's; under the mode, every rank's as a per-rank
    integer; elsewhere the real ones."""
    from torch.distributed._local_tensor import LocalIntNode, enabled_local_tensor_mode

    real_rank, real_members = dist.get_rank, dist.get_process_group_ranks

    def get_rank(group=None):
        rank = current_rank()
        if rank is not None:
            return rank if group is None or group is dist.group.WORLD else group_members(group, rank).index(rank)
        mode = enabled_local_tensor_mode()
        if mode is None:
            _not_elsewhere("dist.get_rank")
            return real_rank(group)
        world = sorted(mode.ranks)
        return torch.SymInt(LocalIntNode({r: r if group is None or group is dist.group.WORLD
                                          else group_members(group, r).index(r) for r in world}))

    def get_process_group_ranks(group):
        rank = current_rank()
        if rank is None or group is None or group is dist.group.WORLD:
            return real_members(group)
        return group_members(group, rank)

    for module in (dist, dist.distributed_c10d):
        patches.set(module, "get_rank", get_rank)
        patches.set(module, "get_process_group_ranks", get_process_group_ranks)


def _install_int_nodes(patches: _Patches) -> None:
    """A per-rank integer read as one Python value: the acting rank's, else `RankDependent` where ranks differ."""
    from torch.distributed._local_tensor import LocalIntNode
    import operator

    patches.set(LocalIntNode, "int_", lambda self: _one(self, "an int"))
    patches.set(LocalIntNode, "guard_int", lambda self, file=None, line=None: _one(self, "an int"))
    patches.set(LocalIntNode, "maybe_as_int", lambda self: _maybe_one(self))
    patches.set(LocalIntNode, "statically_known_true", lambda self: False)
    for name, op in (("eq", operator.eq), ("ne", operator.ne), ("ge", operator.ge), ("le", operator.le),
                     ("gt", operator.gt), ("lt", operator.lt)):
        patches.set(LocalIntNode, name, _compare(op))
    patches.set(LocalIntNode, "_str", lambda self: str(_one_or_text(self)))


def _not_elsewhere(what: str) -> None:
    """`RankDependent` where a thread of the library's own (a loader's pool) asks for this process's rank: the
    local world's mode is on in the thread that entered it only, so the question would silently answer as rank 0
    for every rank."""
    if _home[0] is not None and threading.get_ident() != _home[0]:
        raise RankDependent(f"{what} in thread {threading.current_thread().name!r}, not the local world's, at "
                            f"{_caller()}: the mode is off there, so it would answer rank 0's for every rank")


def _maybe_one(node):
    rank = current_rank()
    return node._local_ints[rank] if rank is not None else None


def _one_or_text(node):
    rank = current_rank()
    return node._local_ints[rank] if rank is not None else f"LocalIntNode({node._local_ints})"


class LocalWorld:
    """An N-rank world in this process: torch's fake process group (this process is its rank 0), the patches
    above, and `mode`, the `LocalTensorMode` of every rank (entered by whoever runs the world's SPMD code)."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"--local-world {size}: a world needs at least one rank")
        self.size = size
        self.mode = None
        self._patches = _Patches()
        self._hook = None

    @property
    def ranks(self) -> list[int]:
        return list(range(self.size))

    def __enter__(self) -> "LocalWorld":
        from torch.distributed._local_tensor import LocalTensorMode
        from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

        if dist.is_initialized():
            raise RuntimeError("a process group is already initialized; a local world needs the process to itself")
        self._hook = sys.excepthook  # init_process_group wraps it with a "[rank0]" prefix
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=self.size)
        try:
            _install(self._patches)
            _home[0] = threading.get_ident()
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        self.mode = LocalTensorMode(self.size)
        return self

    def __exit__(self, *exc) -> None:
        _home[0] = None
        self._patches.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.excepthook = self._hook or sys.excepthook
        _forget_sharding_caches()

    def replicate(self, value):
        """`value` with every tensor in it held by every rank (the same input on each, as a gloo run feeds)."""
        from torch.distributed._local_tensor import LocalTensor

        def one(x):
            if isinstance(x, torch.Tensor) and not isinstance(x, LocalTensor):
                return LocalTensor({r: x.detach().clone() for r in self.ranks})
            return x
        return torch.utils._pytree.tree_map(one, value)


def per_rank_tensors(fn):
    """`fn(rank)` for this process's rank; under an enabled `LocalTensorMode`, `fn(r)` of every rank `r` of its world
    in one value, each tensor a `LocalTensor` holding every rank's (the inputs a rank picks by its rank, such as
    its data shard, given to every rank at once)."""
    from torch.distributed._local_tensor import LocalTensor, enabled_local_tensor_mode

    mode = enabled_local_tensor_mode()
    if mode is None:
        return fn(dist.get_rank())
    ranks = sorted(mode.ranks)
    with mode.disable():
        values = {r: fn(r) for r in ranks}
    flat = {r: torch.utils._pytree.tree_flatten(v) for r, v in values.items()}
    leaves, spec = flat[ranks[0]]
    differ = [r for r in ranks if flat[r][1] != spec or any(
        not isinstance(a, torch.Tensor) and a != b for a, b in zip(flat[r][0], leaves))]
    if differ:  # one rank's value would stand for every rank's: what a local world must never do silently
        raise RankDependent(f"per_rank_tensors: ranks {differ} give another structure or non-tensor value than "
                            f"rank {ranks[0]}; only tensors may differ between ranks")
    joined = [LocalTensor({r: flat[r][0][i] for r in ranks}) if isinstance(leaf, torch.Tensor) else leaf
              for i, leaf in enumerate(leaves)]
    return torch.utils._pytree.tree_unflatten(joined, spec)


def local_value(value, rank: int):
    """Rank `rank`'s value of `value`: its tensor of a `LocalTensor`, its integer of a per-rank integer, else
    `value` (leaves of lists, tuples and dicts too)."""
    from torch.distributed._local_tensor import _map_to_rank_local_val

    return torch.utils._pytree.tree_map(lambda v: _map_to_rank_local_val(v, rank), value)


def _forget_sharding_caches() -> None:
    """DTensor's sharding-propagation caches compare meshes by shape and names only: a later world must not be
    handed this one's (whose groups are gone)."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
