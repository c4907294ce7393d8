"""Per-rank regions of a local world: code that is not the same on every rank, run once per rank, exactly.

`each_rank(fn)` calls `fn(rank)` for every rank of the world, each in a thread of its own that acts as that rank
(`localworld.rank_as`): every `LocalTensor` an operation meets is that rank's tensor, and a collective waits for
every rank to reach it, then is computed once for all of them by `LocalTensorMode`'s own implementation (so a
region and the SPMD code around it agree to the bit) and each rank takes its share. The threads take turns (one
runs at a time), so the order of work is the same on every run.

`per_rank(fn)` wraps a library function: under an enabled `LocalTensorMode` it runs as a region and its results
come back as `LocalTensor`s, differentiable (the backward runs per rank too, with the collectives it issues);
anywhere else it is the function itself. `per_rank_functions(table)` does that for a library's table of
functions by module and name (each adapter's `PER_RANK`), inside its context.

Ranks that diverge (one issues a collective another does not) or raise end the region with `RegionError`, naming
the ranks and what each issued; no thread is left waiting.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
from dataclasses import dataclass, field

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from paracheck.world.localworld import limit, local_value, rank_as

_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_dtensor")
_PASS_THROUGH = ("wait_tensor",)


class RegionError(RuntimeError):
    """The ranks of a region raised or diverged."""


@dataclass
class _Call:
    name: str
    func: object
    args: tuple
    kwargs: dict


@dataclass
class _Exchange:
    """The rendezvous of one region: each rank's n-th collective meets every other rank's n-th."""
    ranks: list[int]
    cond: threading.Condition = field(default_factory=threading.Condition)
    posted: dict = field(default_factory=dict)  # n -> {rank: _Call}
    results: dict = field(default_factory=dict)  # n -> {rank: output}
    taken: dict = field(default_factory=dict)  # n -> ranks that took their output
    finished: set = field(default_factory=set)
    failed: list = field(default_factory=list)  # (rank, exception)
    turn: int | None = None

    # -- turns -----------------------------------------------------------------------------------
    def _runnable(self, rank: int, waiting: dict) -> bool:
        n = waiting.get(rank)
        return n is None or n in self.results or bool(self.failed)

    def wait_turn(self, rank: int, waiting: dict) -> None:
        while not (self.turn == rank and self._runnable(rank, waiting)):
            self.cond.wait()

    def pass_turn(self, rank: int, waiting: dict) -> None:
        """Hand the turn to the next rank (in rank order after `rank`) that can run; with none, the region is
        stuck: ranks wait on collectives others finished without, which `_stuck` reports."""
        order = self.ranks[self.ranks.index(rank) + 1:] + self.ranks[:self.ranks.index(rank) + 1]
        live = [r for r in order if r not in self.finished]
        for r in live:
            if self._runnable(r, waiting):
                self.turn = r
                self.cond.notify_all()
                return
        if live:
            self._stuck(waiting)
            self.turn = live[0]
        self.cond.notify_all()

    def _stuck(self, waiting: dict) -> None:
        ahead = {r: self.posted[n][r].name for r, n in waiting.items() if n is not None and r in self.posted.get(n, {})}
        self.failed.append((None, RegionError(
            f"ranks diverged: {sorted(ahead)} wait in a collective ({_names(ahead)}) that ranks "
            f"{sorted(self.finished)} finished without")))

    # -- collectives -----------------------------------------------------------------------------
    def collective(self, rank: int, n: int, call: _Call, waiting: dict):
        self.posted.setdefault(n, {})[rank] = call
        if len(self.posted[n]) == len(self.ranks):
            self._compute(n)
        waiting[rank] = n
        self.pass_turn(rank, waiting)
        self.wait_turn(rank, waiting)
        waiting[rank] = None
        if self.failed:
            raise RegionError(_failure_text(self.failed))
        out = self.results[n][rank]
        self.taken.setdefault(n, set()).add(rank)
        if len(self.taken[n]) == len(self.ranks):
            del self.posted[n], self.results[n], self.taken[n]
        return out

    def _compute(self, n: int) -> None:
        calls = self.posted[n]
        names = {r: c.name for r, c in calls.items()}
        if len(set(names.values())) != 1 or len({c.func for c in calls.values()}) != 1:
            self.failed.append((None, RegionError(f"ranks diverged at collective #{n}: {_names(names)}")))
            return
        try:
            with rank_as(None):
                self.results[n] = _all_ranks(calls, self.ranks)
        except Exception as exc:  # noqa: BLE001 - the collective's own error, every rank raises it
            self.failed.append((None, exc))


def _names(by_rank: dict) -> str:
    groups: dict[str, list[int]] = {}
    for rank, name in sorted(by_rank.items()):
        groups.setdefault(name, []).append(rank)
    return "; ".join(f"ranks {ranks}: {name}" for name, ranks in groups.items())


def _failure_text(failed: list) -> str:
    rank, exc = failed[0]
    where = f"rank {rank} raised " if rank is not None else ""
    return f"{where}{type(exc).__name__}: {exc}"


def _all_ranks(calls: dict, ranks: list[int]) -> dict:
    """One collective, every rank's call at once, computed by `LocalTensorMode`: each tensor argument becomes a
    `LocalTensor` of the ranks' own (in-place outputs included, so they are written where each rank reads them),
    and each rank takes its part of the result."""
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode, _combine_rank_results

    flat = {r: pytree.tree_flatten((c.args, c.kwargs)) for r, c in calls.items()}
    spec = flat[ranks[0]][1]
    leaves = []
    for i, first in enumerate(flat[ranks[0]][0]):
        values = {r: flat[r][0][i] for r in ranks}
        if isinstance(first, torch.Tensor):
            leaves.append(LocalTensor({r: v.detach() if v.requires_grad else v for r, v in values.items()}))
        elif isinstance(first, int) and not isinstance(first, bool):
            leaves.append(_combine_rank_results(values, None))
        else:
            leaves.append(first)
    args, kwargs = pytree.tree_unflatten(leaves, spec)
    call = calls[ranks[0]]
    with LocalTensorMode(frozenset(ranks)):
        out = call.func(*args, **kwargs)
    return {r: local_value(out, r) for r in ranks}


class _RankMode(TorchDispatchMode):
    """This thread as one rank: `LocalTensor`s read as this rank's tensor, collectives through the exchange."""

    def __init__(self, rank: int, exchange: _Exchange, waiting: dict):
        super().__init__()
        self.rank, self.exchange, self.waiting = rank, exchange, waiting
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.distributed._local_tensor import LocalTensor

        kwargs = kwargs or {}
        if any(issubclass(t, FakeTensor) for t in types):
            return func(*args, **kwargs)  # shapes alone (DTensor's sharding propagation): no rank's values in it
        if any(not issubclass(t, LocalTensor) and t is not torch.Tensor and t is not torch.nn.Parameter
               for t in types):
            return NotImplemented  # another subclass (DTensor) desugars first; its local ops come back here
        args, kwargs = local_value((args, kwargs), self.rank)
        if func.namespace not in _COLLECTIVE_NAMESPACES or func._schema.name.split("::")[-1] in _PASS_THROUGH:
            return func(*args, **kwargs)
        self.count += 1
        call = _Call(func._schema.name, func, args, kwargs)
        return self.exchange.collective(self.rank, self.count, call, self.waiting)


def each_rank(fn, ranks: list[int], carry_modes: bool = True) -> dict:
    """`{rank: fn(rank)}`, every rank in a thread of its own acting as that rank (see the module docstring).

    With `carry_modes`, the first rank's thread also runs under the dispatch modes the caller has (those that are
    not `LocalTensorMode`): a counter of collectives sees one rank's, as it sees the world's SPMD code once."""
    from torch.distributed._local_tensor import LocalTensorMode, local_tensor_mode

    outer = [m for m in _get_current_dispatch_mode_stack() if not isinstance(m, LocalTensorMode)] if carry_modes else []
    exchange = _Exchange(list(ranks))
    waiting: dict = {r: None for r in ranks}
    results: dict = {}
    grad = torch.is_grad_enabled()

    def body(rank: int) -> None:
        with exchange.cond:
            exchange.wait_turn(rank, waiting)
            try:
                # The caller's modes above this rank's (they see each operation first, as they would under the
                # world's mode), this rank's beneath them.
                with rank_as(rank), torch.set_grad_enabled(grad), _RankMode(rank, exchange, waiting), \
                        _modes(outer if rank == ranks[0] else []):
                    results[rank] = fn(rank)
            except BaseException as exc:  # noqa: BLE001 - carried to the caller, once
                if not any(r == rank for r, _ in exchange.failed):
                    exchange.failed.append((rank, exc))
            finally:
                exchange.finished.add(rank)
                exchange.pass_turn(rank, waiting)

    lm = local_tensor_mode()
    with (lm.disable() if lm is not None else _nothing()):
        threads = [threading.Thread(target=body, args=(r,), name=f"paracheck-rank-{r}", daemon=True) for r in ranks]
        with exchange.cond:
            exchange.turn = ranks[0]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if exchange.failed:
        rank, exc = exchange.failed[0]
        if isinstance(exc, RegionError) or rank is None or limit(type(exc).__name__):
            raise exc  # a local world's limit keeps its type: the case becomes a skip that says why
        raise RegionError(f"rank {rank} raised {type(exc).__name__}: {exc}") from exc
    return results


def once_per_rank(fn):
    """`fn()` once per rank of the enabled `LocalTensorMode`'s world, each acting as its rank (`each_rank`);
    outside a local world, `fn()` once: rank-dependent code of the kit's own, run as each rank would. Returns its
    value, which must be the same on every rank (`RankDependent` where it is not)."""
    from torch.distributed._local_tensor import enabled_local_tensor_mode

    mode = enabled_local_tensor_mode()
    if mode is None:
        return fn()
    values = each_rank(lambda rank: fn(), sorted(mode.ranks), carry_modes=False)
    first = values[min(values)]
    if any(isinstance(value, torch.Tensor) for value in values.values()):
        raise TypeError(f"once_per_rank({getattr(fn, '__qualname__', fn)}): returned a tensor; it must return a plain "
                        "value each rank can be compared on (per_rank_tensors takes tensors)")
    if any(value != first for value in values.values()):
        from paracheck.world.localworld import RankDependent

        raise RankDependent(f"{getattr(fn, '__qualname__', fn)} returned another value on some ranks: {values}")
    return first


def as_control_asks(per_rank: bool, fn, *args):
    """`fn(*args)` as a control asks it planted: once per rank of a local world where it says so (`Control.per_rank`:
    its planter picks by its rank in Python; `once_per_rank`), else once."""
    call = functools.partial(fn, *args)
    return once_per_rank(call) if per_rank else call()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


class _modes:
    """Enter the given dispatch modes (outermost first) for the block."""

    def __init__(self, modes):
        self.modes = list(modes)

    def __enter__(self):
        for mode in self.modes:
            mode.__enter__()

    def __exit__(self, *exc):
        for mode in reversed(self.modes):
            mode.__exit__(*exc)
        return False


# -- a library function as a differentiable region --------------------------------------------------------


def per_rank(fn, ranks_of=None):
    """`fn`, run per rank when called under an enabled `LocalTensorMode` (see the module docstring)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from torch.distributed._local_tensor import enabled_local_tensor_mode

        mode = enabled_local_tensor_mode()
        if mode is None:
            return fn(*args, **kwargs)
        return _region(fn, sorted(mode.ranks), args, kwargs)

    wrapper.__paracheck_per_rank__ = fn
    return wrapper


@contextlib.contextmanager
def per_rank_functions(table):
    """Inside: each library function of `table` ((module, attribute path, kind, why) rows, kind "function" for
    a function or a method, "classmethod", or "apply" for an autograd Function) runs per rank (`per_rank`);
    restored on exit, also on error."""
    undo = []
    try:
        for module_name, path, kind, _ in table:
            owner = importlib.import_module(module_name)
            *parents, name = path.split(".")
            for parent in parents:
                owner = getattr(owner, parent)
            original = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name)
            if kind == "function":
                setattr(owner, name, per_rank(original))
            elif kind == "classmethod":
                setattr(owner, name, classmethod(per_rank(original.__func__)))
            else:  # an autograd Function: its apply, forward and backward per rank
                original = getattr(owner, name)
                undo.append((original, "apply", original.__dict__.get("apply")))
                original.apply = staticmethod(per_rank(original.apply))
                continue
            undo.append((owner, name, original))
        yield
    finally:
        for owner, name, original in reversed(undo):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def _region(fn, ranks: list[int], args, kwargs):
    from torch.distributed._local_tensor import LocalTensor

    flat, spec = pytree.tree_flatten((args, kwargs))
    for i, value in enumerate(flat):
        if isinstance(value, torch.Tensor) and not isinstance(value, LocalTensor) and value.requires_grad:
            raise RegionError(f"{fn.__qualname__}: argument {i} is a plain tensor that requires grad under "
                              "LocalTensorMode, whose gradient no rank would own")
    # A plain tensor under the mode is the same on every rank (an input every rank was given): each rank reads it.
    where = [i for i, v in enumerate(flat) if isinstance(v, LocalTensor)]
    tensors = [flat[i] for i in where]
    box: dict = {}
    outs = _Region.apply(fn, ranks, flat, spec, where, box, *tensors)
    return pytree.tree_unflatten(_fill(box["leaves"], outs), box["spec"])


def _fill(leaves: list, tensors) -> list:
    tensors = list(tensors)
    return [tensors.pop(0) if leaf is _TENSOR else leaf for leaf in leaves]


_TENSOR = object()


class _Region(torch.autograd.Function):
    """Forward: `fn` per rank on each rank's tensors (a graph per rank where gradients are wanted); backward: each
    rank's graph, per rank, with each rank's incoming gradient."""

    @staticmethod
    def forward(ctx, fn, ranks, flat, spec, where, box, *tensors):
        wants = [t.requires_grad for t in tensors]
        grad = torch.is_grad_enabled() or any(wants)  # inside Function.forward grad is off; the graph is per rank
        inputs: dict = {}

        def run(rank: int):
            mine = list(flat)
            inputs[rank] = []
            for i, tensor, want in zip(where, tensors, wants):
                local = tensor._local_tensors[rank]
                mine[i] = local.detach().requires_grad_(want) if want else local
                inputs[rank].append(mine[i])
            with torch.set_grad_enabled(any(wants)):
                a, k = pytree.tree_unflatten(mine, spec)
                return fn(*a, **k)

        results = each_rank(run, ranks)
        del grad
        _same_shapes(fn, ranks, results)
        first = pytree.tree_flatten(results[ranks[0]])
        box["spec"] = first[1]
        per_rank_leaves = {r: pytree.tree_flatten(results[r])[0] for r in ranks}
        outs, leaves, ctx.outputs = [], [], {r: [] for r in ranks}
        for i, leaf in enumerate(first[0]):
            if isinstance(leaf, torch.Tensor):
                for r in ranks:
                    ctx.outputs[r].append(per_rank_leaves[r][i])
                outs.append(_local(ranks, {r: per_rank_leaves[r][i].detach() for r in ranks}))
                leaves.append(_TENSOR)
            else:
                leaves.append(_combine(ranks, {r: per_rank_leaves[r][i] for r in ranks}))
        box["leaves"] = leaves
        ctx.ranks, ctx.inputs, ctx.wants = ranks, inputs, wants
        ctx.mark_non_differentiable(*[o for o, r in zip(outs, ctx.outputs[ranks[0]]) if not r.requires_grad])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        ranks = ctx.ranks

        def run(rank: int):
            outputs = ctx.outputs[rank]
            pairs = [(o, g._local_tensors[rank] if g is not None else None) for o, g in zip(outputs, grads)
                     if o.requires_grad]
            wanted = [x for x, want in zip(ctx.inputs[rank], ctx.wants) if want]
            if not pairs or not wanted:
                return [None] * len(wanted)
            return list(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True))

        per_rank_grads = each_rank(run, ranks, carry_modes=False)
        out, k = [], 0
        for want in ctx.wants:
            if not want:
                out.append(None)
                continue
            values = {r: per_rank_grads[r][k] for r in ranks}
            k += 1
            out.append(None if all(v is None for v in values.values()) else _local(ranks, {
                r: v if v is not None else torch.zeros_like(ctx.inputs[r][0]) for r, v in values.items()}))
        return (None, None, None, None, None, None, *out)


def _same_shapes(fn, ranks: list[int], results: dict) -> None:
    """Refuse, as a local world's limit, outputs whose shape differs between ranks (an uneven split): a
    `LocalTensor` holds them with per-rank symbolic sizes, which torch's own ops and the library's Python then
    fail on far from here, each in its own words."""
    from paracheck.world.localworld import NoLocalRule

    flat = {r: pytree.tree_flatten(results[r]) for r in ranks}
    leaves = {r: leaf for r, (leaf, _) in flat.items()}
    _same_structure(fn, ranks, flat)
    for i, leaf in enumerate(leaves[ranks[0]]):
        if not isinstance(leaf, torch.Tensor):
            continue
        shapes = {r: tuple(leaves[r][i].shape) for r in ranks}
        if len(set(shapes.values())) > 1:
            raise NoLocalRule(f"{fn.__qualname__} gives ranks tensors of different shapes ({_by_shape(shapes)}): "
                              "LocalTensorMode holds uneven shards as per-rank symbolic sizes, which torch's ops "
                              "and the library cannot compute with")


def _same_structure(fn, ranks: list[int], flat: dict) -> None:
    """Refuse, as a local world's limit, outputs that are a tensor on some ranks and not on others (or of another
    structure): rank 0's would otherwise stand for every rank's, or fail far from here. transformers' expert
    parallel load is one: `shard_tensor` gives each rank its own experts and `None` for the others'."""
    from paracheck.world.localworld import RankDependent

    leaves, spec = flat[ranks[0]]
    kinds = [isinstance(leaf, torch.Tensor) for leaf in leaves]
    differ = [r for r in ranks if flat[r][1] != spec
              or [isinstance(leaf, torch.Tensor) for leaf in flat[r][0]] != kinds]
    if differ:
        raise RankDependent(f"{fn.__qualname__} gives ranks {differ} another structure than rank {ranks[0]} "
                            f"({_kinds(flat[ranks[0]][0])} against {_kinds(flat[differ[0]][0])}): one "
                            "process holds one structure for every rank")


def _kinds(leaves: list) -> str:
    return "[" + ", ".join("tensor" if isinstance(x, torch.Tensor) else type(x).__name__ for x in leaves) + "]"


def _by_shape(shapes: dict) -> str:
    groups: dict = {}
    for rank, shape in sorted(shapes.items()):
        groups.setdefault(shape, []).append(rank)
    return "; ".join(f"ranks {ranks}: {list(shape)}" for shape, ranks in groups.items())


def _local(ranks, tensors: dict):
    from torch.distributed._local_tensor import LocalTensor

    return LocalTensor({r: tensors[r] for r in ranks})


def _combine(ranks, values: dict):
    from torch.distributed._local_tensor import _combine_any_rank_results

    return _combine_any_rank_results({r: values[r] for r in ranks})
