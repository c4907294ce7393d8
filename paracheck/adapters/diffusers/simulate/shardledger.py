"""Shard indices without values: which rows of a planned parameter each meta tensor holds, and
structure.tp_shards judged from them in a simulation.

Meta tensors hold no values, so the kit's `structure.tp_shards` (which compares a shard bitwise with the
reference's slice) cannot run on meta. `ShardLedger` carries indices instead: it follows every slice,
split, cat and copy of a planned parameter and knows which rows of the full parameter each local shard
holds. Where torch scatters a shard (on meta the scatter moves nothing), the index is the one the
DTensor's mesh coordinate implies.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from paracheck.checks.compare import problems_text
from paracheck.domain.layout import tp_shard
from paracheck.domain.records import CheckId, CheckResult, Status


@dataclass(frozen=True)
class Provenance:
    """A tensor equals rows `intervals` (start, length), concatenated, of parameter `name` along `dim`;
    `dim` None means the whole parameter."""

    name: str
    dim: int | None = None
    intervals: tuple = ()

    def along(self, dim: int, size: int) -> "Provenance":
        """The same content described along `dim` (a whole parameter is one interval)."""
        if self.dim is None:
            return Provenance(self.name, dim, ((0, size),))
        return self


def merge_intervals(intervals) -> tuple:
    """Adjacent (start, length) intervals joined, empty ones dropped."""
    out: list[list[int]] = []
    for start, length in intervals:
        if length <= 0:
            continue
        if out and out[-1][0] + out[-1][1] == start:
            out[-1][1] += length
        else:
            out.append([start, length])
    return tuple((s, n) for s, n in out)


def sub_intervals(intervals, start: int, stop: int) -> tuple:
    """Rows [start, stop) of the concatenation of `intervals`."""
    out, position = [], 0
    for begin, length in intervals:
        lo, hi = max(start, position), min(stop, position + length)
        if lo < hi:
            out.append((begin + lo - position, hi - lo))
        position += length
    return merge_intervals(out)


# -- the ledger -----------------------------------------------------------------------------------


def _arg(args, kwargs, name: str, index: int, default=None):
    return kwargs.get(name, args[index] if len(args) > index else default)


@functools.cache
def ledger_class():
    """The `ShardLedger` class (a `TorchDispatchMode`; built once, on first use, so importing this needs no mode)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.weak import WeakTensorKeyDictionary

    aten = torch.ops.aten
    same = {aten.detach.default, aten.alias.default, aten.clone.default, aten._to_copy.default,
            aten.lift_fresh.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default,
            aten.expand.default}
    splits = {aten.split.Tensor, aten.split_with_sizes.default, aten.unsafe_split.Tensor,
              aten.split_with_sizes_copy.default, aten.split_copy.Tensor}
    followed = same | splits | {aten.copy_.default, aten.cat.default, aten.slice.Tensor}

    class ShardLedger(TorchDispatchMode):
        """Follows which rows of which planned parameter every derived tensor holds (no values needed)."""

        def __init__(self):
            super().__init__()
            self.prov = WeakTensorKeyDictionary()
            self._writes: dict = {}

        def register(self, tensor, name: str):
            self.prov[tensor] = Provenance(name)

        def provenance(self, tensor) -> Provenance | None:
            return self.prov.get(tensor)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if isinstance(func, torch._ops.HigherOrderOperator):
                return func(*args, **kwargs)
            if any(isinstance(t, type) and issubclass(t, DTensor) for t in types):
                return NotImplemented  # DTensor desugars into ops on its local tensors, which come back here
            out = func(*args, **kwargs)
            if not self.prov:
                return out
            if func not in followed:
                self._forget_written(func, args)
                return out
            try:
                self._follow(func, args, kwargs, out)
            except Exception:  # the ledger must never break the library's code path
                pass
            return out

        def _forget_written(self, func, args):
            """An op the ledger does not follow wrote into its arguments: they hold unknown rows now."""
            writes = self._writes.get(func)
            if writes is None:
                writes = self._writes[func] = tuple(
                    i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write)
            for index in writes:
                if index < len(args) and isinstance(args[index], torch.Tensor):
                    self._write(args[index], None)

        def _get(self, value):
            return self.prov.get(value) if isinstance(value, torch.Tensor) else None

        def _follow(self, func, args, kwargs, out):
            if func is aten.copy_.default:
                self._copy(args[0], args[1])
            elif not args:
                return
            elif func is aten.cat.default:
                self._cat(list(args[0]), _arg(args, kwargs, "dim", 1, 0), out)
            elif self._get(args[0]) is None:
                return
            elif func in same:
                if isinstance(out, torch.Tensor) and tuple(out.shape) == tuple(args[0].shape):
                    self.prov[out] = self._get(args[0])
            elif func is aten.slice.Tensor:
                self._slice_op(args, kwargs, out)
            elif func in splits:
                self._split(args[0], _arg(args, kwargs, "dim", 2, 0) % args[0].dim(), out)

        def _copy(self, dst, src):
            source = self._get(src)
            self._write(dst, source if source is not None and tuple(dst.shape) == tuple(src.shape) else None)

        def _cat(self, tensors, dim: int, out):
            if not tensors or not isinstance(out, torch.Tensor):
                return
            dim %= tensors[0].dim()
            parts = []
            for t in tensors:
                p = self._get(t)
                if p is None:
                    return
                p = p.along(dim, t.shape[dim])
                if p.dim != dim or (parts and p.name != parts[0].name):
                    return
                parts.append(p)
            self.prov[out] = Provenance(parts[0].name, dim, merge_intervals(i for p in parts for i in p.intervals))

        def _slice_op(self, args, kwargs, out):
            first = args[0]
            dim = _arg(args, kwargs, "dim", 1, 0) % first.dim()
            if _arg(args, kwargs, "step", 4, 1) != 1:
                return
            start, end, _ = slice(_arg(args, kwargs, "start", 2), _arg(args, kwargs, "end", 3)).indices(first.shape[dim])
            self._slice(out, self._get(first), first, dim, start, end)

        def _split(self, first, dim: int, pieces):
            position = 0
            for piece in pieces:
                length = piece.shape[dim]
                self._slice(piece, self._get(first), first, dim, position, position + length)
                position += length

        def _write(self, tensor, source):
            """`tensor` was written in place: it (and a base it views whole) now holds `source`."""
            targets = [tensor]
            base = tensor._base
            if base is not None:
                whole = (tuple(base.shape) == tuple(tensor.shape) and base.stride() == tensor.stride()
                         and base.storage_offset() == tensor.storage_offset())
                targets.append(base)
                if not whole:
                    source = None  # part of the base was overwritten: it is no longer one block of rows
            for target in targets:
                if source is None:
                    self.prov.pop(target, None)
                else:
                    self.prov[target] = source

        def _slice(self, out, source: Provenance, base, dim: int, start: int, end: int):
            size = base.shape[dim]
            if start == 0 and end >= size:
                self.prov[out] = source
                return
            source = source.along(dim, size)
            if source.dim != dim:
                return  # a slice across another dimension than the shard's: no longer one block of rows
            self.prov[out] = Provenance(source.name, dim, sub_intervals(source.intervals, start, end))

    return ShardLedger


def shard_ledger():
    """A fresh `ShardLedger` (a `TorchDispatchMode`): `register(tensor, name)`, then use it as a context
    manager around code that slices/copies; `provenance(tensor)` tells which rows of `name` it holds."""
    return ledger_class()()


# -- structure.tp_shards on meta -------------------------------------------------------------------


def expected_intervals(spec, index: int, tp: int) -> tuple:
    """Rows of the full parameter that TP shard `index` of `tp` holds along `spec.dim` (block by block)."""
    return merge_intervals(tp_shard(spec.block_sizes, index, tp))


def shard_index(spec, intervals, tp: int) -> int | None:
    """The TP shard index whose rows are `intervals`, or None when they are no shard."""
    for index in range(tp):
        if expected_intervals(spec, index, tp) == merge_intervals(intervals):
            return index
    return None


def check_tp_shards_meta(model, specs: dict, applied, ledger) -> CheckResult:
    """structure.tp_shards without values: mesh, placements, local shape and the rows each shard holds."""
    from torch.distributed.tensor import DTensor

    params = dict(model.named_parameters())
    problems, untraced = [], []
    if applied.layout.has_tp:
        for name, spec in specs.items():
            problems.extend(_meta_shard_problems(name, params.get(name), spec, applied, ledger, untraced))
    problems.extend(f"{name} is outside the TP plan but is a DTensor"
                    for name, param in params.items() if name not in specs and isinstance(param, DTensor))
    detail = problems_text(problems)
    if not problems and untraced:
        detail = f"{len(untraced)} shard indices from DTensor coordinates (torch scatters them), the rest traced"
    return CheckResult(CheckId.TP_SHARDS, Status.FAIL if problems else Status.PASS, detail)


def _meta_shard_problems(name: str, param, spec, applied, ledger, untraced: list) -> list[str]:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    layout, rank = applied.layout, applied.rank
    if not isinstance(param, DTensor):
        return [f"{name} is not a DTensor"]
    problems = []
    ranks = sorted(dist.get_process_group_ranks(param.device_mesh.get_group()))
    if ranks != layout.tp_group(rank):
        problems.append(f"{name} lives on ranks {ranks}, TP group is {layout.tp_group(rank)}")
    want = Replicate() if spec.dim is None else Shard(spec.dim)
    if tuple(param.placements) != (want,):
        return problems + [f"{name} placed {param.placements}, plan says {want}"]
    shape = list(param.shape)
    if spec.dim is not None:
        shape[spec.dim] = sum(length for _, length in tp_shard(spec.block_sizes, 0, layout.tp))
    if list(param._local_tensor.shape) != shape:
        return problems + [f"{name} local shape {list(param._local_tensor.shape)} != TP shard shape {shape}"]
    if spec.dim is None:
        return problems
    rows = _shard_rows(name, param, spec, ledger, untraced)
    if isinstance(rows, str):
        return problems + [rows]
    index = layout.coords(rank)["tp"]
    if merge_intervals(rows) != expected_intervals(spec, index, layout.tp):
        got = shard_index(spec, rows, layout.tp)
        what = f"TP shard {got}" if got is not None else f"rows {list(merge_intervals(rows))}"
        problems.append(f"{name} holds {what} of {layout.tp}, its TP-mesh coordinate is {index}")
    return problems


def _shard_rows(name: str, param, spec, ledger, untraced: list):
    """The rows of the full parameter this rank's shard holds (intervals), or a problem (str)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = param._local_tensor
    source = ledger.provenance(local)
    if source is not None:
        if source.name != name:
            return f"{name} holds rows of {source.name}"
        got = source.along(spec.dim, param.shape[spec.dim])
        if got.dim != spec.dim:
            return f"{name} holds a slice along dim {got.dim}, plan shards dim {spec.dim}"
        return got.intervals
    untraced.append(name)
    if len(spec.block_sizes) > 1:
        return f"{name} is packed, and which rows its shard holds could not be traced"
    # Scattered by torch (nothing moves on meta): the rows the DTensor's mesh coordinate selects.
    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return ((offset[spec.dim], local.shape[spec.dim]),)
