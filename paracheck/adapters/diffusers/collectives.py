"""Collectives as structure: what one forward issues on a rank, per process group and per attention call.

`count_collectives` is a `TorchDispatchMode` that records every collective dispatched inside it, keyed by
its kind and the ranks of the process group it ran over. Like torch's `CommDebugMode` it returns
`NotImplemented` for DTensor ops, so DTensor desugars first and the counter sees TP's redistributions; it
sees diffusers' Ulysses all-to-alls, ring KV gathers and the CP hooks' gathers directly (functional
collectives). Unlike `CommDebugMode` it records the group, and it tells the collectives of each attention
call apart from the rest: every attention backend runs inside an observer (`library.observed_attention`)
that notes whether the call was dispatched with a parallel config, which is how diffusers' processors say
"run this call context-parallel" (Wan's cross-attention, for one, holds the config and passes none).

`check_counts` is pure: counts in, one `CheckResult` out (`structure.collectives`). The rules:

- An attention call dispatched with the CP config communicates: with Ulysses it all-to-alls over this
  rank's Ulysses group, with ring it gathers or rotates the KV over this rank's ring group, and it uses no
  other group. A call dispatched without a config runs on this rank's tensors and issues no collective.
- CP (cp > 1): some attention call runs context-parallel (else every rank attended its own shard), and the
  output is gathered over the CP group; a CP layout that issues no CP collective at all fails.
- TP (tp > 1): TP's all-reduces run over this rank's TP group, and at least one runs.
- Any layout: an all-to-all outside the Ulysses group, an all-reduce outside the TP group, or a collective
  over ranks that form no group of the layout, fails.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from dataclasses import dataclass, field

from paracheck.domain.layout import Layout
from paracheck.domain.records import CheckId, CheckResult, Status

CHECK_ID = CheckId.COLLECTIVES

#: op name (without namespace and overload) -> kind
_KINDS = {
    "all_to_all_single": "all_to_all",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
    "scatter_": "scatter",
    "gather_": "gather",
    "reduce_": "reduce",
    "send": "send",
    "recv_": "recv",
    "permute_tensor": "permute",
}
_NAMESPACES = ("_c10d_functional", "c10d_functional", "c10d")
_GROUP_ARGS = ("group_name", "process_group", "group", "tag")
_NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier")
#: Kinds that move the KV around a ring group.
_KV_KINDS = ("all_gather", "permute", "send", "recv")

Ops = Counter  # (kind, group) -> count


def _sorted_ops(ops: Ops) -> list:
    return sorted(ops.items(), key=lambda item: (item[0][0], item[0][1] or ()))


def _ops_json(ops: Ops) -> list[dict]:
    return [{"kind": k, "group": list(g) if g is not None else None, "count": n} for (k, g), n in _sorted_ops(ops)]


def _ops_from_json(items: list[dict]) -> Ops:
    return Counter({(o["kind"], tuple(o["group"]) if o["group"] is not None else None): o["count"] for o in items})


def _ops_text(ops: Ops) -> str:
    return ", ".join(f"{n} {k} over {list(g) if g else '?'}" for (k, g), n in _sorted_ops(ops)) or "none"


@dataclass(frozen=True)
class CallShape:
    """What one attention call was dispatched with and what it issued (its collectives, each counted)."""
    parallel: bool
    ops: tuple = ()  # sorted ((kind, group), count) pairs

    @classmethod
    def of(cls, parallel: bool, ops: Ops) -> "CallShape":
        return cls(parallel, tuple(_sorted_ops(ops)))

    @property
    def counter(self) -> Ops:
        return Counter(dict(self.ops))


@dataclass
class Counts:
    """One rank's collectives: those outside attention by (kind, group), and its attention calls by shape."""

    rank: int
    #: Collectives outside any attention call (the CP hooks' gathers, TP's all-reduces): (kind, group) -> n.
    outside: Ops = field(default_factory=Counter)
    #: CallShape -> how many attention calls had it.
    attention: Counter = field(default_factory=Counter)
    #: Op names seen that have no kind here (reported, never counted as a kind).
    unknown: Counter = field(default_factory=Counter)

    @property
    def ops(self) -> Ops:
        """Every collective, inside attention or not: (kind, group) -> n."""
        total = Counter(self.outside)
        for shape, calls in self.attention.items():
            for key, n in shape.ops:
                total[key] += n * calls
        return total

    def calls(self, parallel: bool | None = None) -> int:
        return sum(n for s, n in self.attention.items() if parallel is None or s.parallel == parallel)

    def count(self, kind: str, group: tuple[int, ...] | None = None) -> int:
        return sum(n for (k, g), n in self.ops.items() if k == kind and (group is None or g == group))

    def to_json(self) -> dict:
        shapes = sorted(self.attention.items(), key=lambda i: (not i[0].parallel, i[0].ops))
        return {
            "rank": self.rank,
            "attention": [{"parallel": s.parallel, "calls": n, "per_call": _ops_json(s.counter)} for s, n in shapes],
            "outside": _ops_json(self.outside),
            "unknown": dict(self.unknown),
        }

    def seen_by(self, rank: int, move) -> "Counts":
        """These counts as rank `rank` has them, where they were counted once for every rank of a local world (as
        its rank `self.rank`): every group moved to its counterpart holding `rank` (`move(group) -> group`)."""
        def moved(ops: Ops) -> Ops:
            out: Ops = Counter()
            for (kind, group), n in ops.items():
                out[(kind, move(group) if group is not None else None)] += n
            return out
        attention = Counter()
        for shape, calls in self.attention.items():
            attention[CallShape.of(shape.parallel, moved(shape.counter))] += calls
        return Counts(rank, moved(self.outside), attention, Counter(self.unknown))

    @classmethod
    def from_json(cls, data: dict) -> "Counts":
        attention = Counter({CallShape.of(a["parallel"], _ops_from_json(a["per_call"])): a["calls"]
                             for a in data.get("attention", [])})
        return cls(data["rank"], _ops_from_json(data.get("outside", [])), attention, Counter(data.get("unknown", {})))

    def summary(self) -> str:
        parts = []
        for shape, n in sorted(self.attention.items(), key=lambda i: (not i[0].parallel, i[0].ops)):
            how = "context-parallel" if shape.parallel else "local"
            parts.append(f"{n} {how} attention call{'s' if n != 1 else ''}"
                         + (f", each {_ops_text(shape.counter)}" if shape.ops else ""))
        if self.outside:
            parts.append(f"outside attention {_ops_text(self.outside)}")
        return "; ".join(parts) or "no collectives, no attention calls"


# -- counting (torch) ------------------------------------------------------------------------------


def _group_ranks(value) -> tuple[int, ...] | None:
    import torch
    import torch.distributed as dist

    try:
        if isinstance(value, str):  # functional collectives name their group
            from torch.distributed.distributed_c10d import _resolve_process_group

            value = _resolve_process_group(value)
        elif isinstance(value, torch.ScriptObject):  # c10d ops (`dist.all_gather` & co.) box theirs
            value = dist.ProcessGroup.unbox(value)
        if isinstance(value, dist.ProcessGroup):
            return tuple(dist.get_process_group_ranks(value))
    except Exception:
        return None
    return None


def _group_of(func, args, kwargs) -> tuple[int, ...] | None:
    for index, argument in enumerate(func._schema.arguments):
        if argument.name in _GROUP_ARGS:
            group = _group_ranks(kwargs.get(argument.name, args[index] if index < len(args) else None))
            if group is not None:
                return group
    return None


class _Recorder:
    """Where the collectives go: the innermost open attention call's tally, else `counts.outside`."""

    def __init__(self, counts: Counts):
        self.counts = counts
        self.open: list[Ops] = []

    def record(self, func, args, kwargs) -> None:
        name = func._schema.name.split("::")[-1]
        kind = _KINDS.get(name)
        if kind is None:
            if name not in _NOT_COLLECTIVES:
                self.counts.unknown[name] += 1
            return
        (self.open[-1] if self.open else self.counts.outside)[(kind, _group_of(func, args, kwargs))] += 1

    @contextlib.contextmanager
    def attention_call(self, parallel_config):
        self.open.append(Counter())
        try:
            yield
        finally:
            ops = self.open.pop()
            self.counts.attention[CallShape.of(parallel_config is not None, ops)] += 1


@functools.cache  # one class for every count: a rank counts every case's forward
def _make_mode():
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Mode(TorchDispatchMode):
        def __init__(self, recorder: _Recorder):
            super().__init__()
            self.recorder = recorder

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if isinstance(func, torch._ops.HigherOrderOperator):
                return func(*args, **kwargs)
            if any(isinstance(t, type) and issubclass(t, DTensor) for t in types):
                return NotImplemented  # let DTensor desugar into the collectives we then see
            out = func(*args, **kwargs)
            if func.namespace in _NAMESPACES:
                self.recorder.record(func, args, kwargs)
            return out

    return _Mode


@contextlib.contextmanager
def count_collectives(rank: int | None = None, observe=None):
    """Count the collectives dispatched inside the block, and which attention call issued each.

    Yields a `Counts`; read it after the block. Works in a real world and under the fake process group
    on the meta device (where the functional collectives run their meta kernels and move nothing).
    `observe(callback)`: the library's context manager that calls `callback(name)` around each attention call
    (the adapter's; without one, collectives are counted but none is tied to an attention call). Attention
    backends registered inside the block are not observed: enter it inside the adapter's attention scope.
    """
    import torch.distributed as dist

    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    counts = Counts(rank)
    recorder = _Recorder(counts)
    with (observe(recorder.attention_call) if observe else contextlib.nullcontext()), _make_mode()(recorder):
        yield counts


# -- check_counts (pure) ----------------------------------------------------------------------------


def expected_groups(layout: Layout, rank: int) -> dict[str, tuple[int, ...]]:
    """The groups this rank's collectives may use, by role; only parallel dimensions of size > 1."""
    groups = {}
    if layout.tp > 1:
        groups["tp"] = tuple(layout.group(rank, ("tp",)))
    if layout.ulysses > 1:
        groups["ulysses"] = tuple(layout.group(rank, ("ulysses",)))
    if layout.ring > 1:
        groups["ring"] = tuple(layout.group(rank, ("ring",)))
    if layout.has_cp:
        groups["cp"] = tuple(layout.cp_group(rank))
    return groups


class _Rules:
    """The rules of the module docstring for one rank's counts; `problems` collects what breaks them."""

    def __init__(self, counts: Counts, layout: Layout, rank: int):
        self.counts, self.layout = counts, layout
        self.groups = {role: tuple(sorted(m)) for role, m in expected_groups(layout, rank).items()}
        self.roles: dict[tuple, list[str]] = {}
        for role, members in self.groups.items():
            self.roles.setdefault(members, []).append(role)
        self.problems: list[str] = []

    def over(self, ops: Ops, kinds, role: str) -> int:
        members = self.groups.get(role)
        return sum(n for (k, g), n in ops.items() if k in kinds and g is not None and tuple(sorted(g)) == members)

    def found(self) -> list[str]:
        for shape, calls in sorted(self.counts.attention.items(), key=lambda i: (not i[0].parallel, i[0].ops)):
            (self._parallel_call if shape.parallel else self._local_call)(shape.counter, calls)
        if self.layout.has_cp:
            self._cp()
        if self.layout.tp > 1 and self.over(self.counts.outside, ("all_reduce",), "tp") == 0:
            self.problems.append(f"no all-reduce over the TP group {list(self.groups['tp'])}")
        self._groups(self.counts.ops)
        return self.problems

    def _parallel_call(self, ops: Ops, calls: int) -> None:
        head = f"{calls} attention call{'s' if calls != 1 else ''} dispatched with a parallel config"
        if not self.layout.has_cp:
            self.problems.append(f"{head} on {self.layout}, which has no context parallelism")
            return
        missing = []
        if self.layout.ulysses > 1 and self.over(ops, ("all_to_all",), "ulysses") == 0:
            missing.append(f"no all-to-all over the Ulysses group {list(self.groups['ulysses'])}")
        if self.layout.ring > 1 and self.over(ops, _KV_KINDS, "ring") == 0:
            missing.append(f"no KV gather or rotation over the ring group {list(self.groups['ring'])}")
        if missing:
            self.problems.append(f"{head} issued {' and '.join(missing)}")
        cp_groups = {self.groups[r] for r in ("ulysses", "ring") if r in self.groups}
        for (kind, group), n in _sorted_ops(ops):
            if group is not None and len(group) > 1 and tuple(sorted(group)) not in cp_groups:
                self.problems.append(f"{head} issued {n} {kind} over {list(group)}, neither its Ulysses nor "
                                     "its ring group")

    def _local_call(self, ops: Ops, calls: int) -> None:
        moved = Counter({(k, g): n for (k, g), n in ops.items() if g is None or len(g) > 1})
        if moved:
            self.problems.append(f"{calls} attention call{'s' if calls != 1 else ''} dispatched without a parallel "
                                 f"config issued collectives ({_ops_text(moved)} each)")

    def _cp(self) -> None:
        cp = list(self.groups["cp"])
        cp_groups = {self.groups[r] for r in ("cp", "ulysses", "ring") if r in self.groups}
        if not any(g is not None and tuple(sorted(g)) in cp_groups for _, g in self.counts.ops):
            self.problems.append(f"a CP layout issued no collective over its CP groups ({cp})")
        if self.counts.calls(parallel=True) == 0:
            missing = [f"no all-to-all over the Ulysses group {list(self.groups['ulysses'])}"] \
                if "ulysses" in self.groups else []
            missing += [f"no KV gather over the ring group {list(self.groups['ring'])}"] if "ring" in self.groups else []
            self.problems.append(f"no attention call was dispatched with the CP config "
                                 f"({self.counts.calls(parallel=False)} ran on this rank's shard alone), so "
                                 + " and ".join(missing))
        if self.over(self.counts.outside, ("all_gather",), "cp") == 0:
            self.problems.append(f"the output is not gathered over the CP group {cp}")

    def _groups(self, ops: Ops) -> None:
        for (kind, group), n in _sorted_ops(ops):
            if group is None:
                self.problems.append(f"{n} {kind} over an unknown group")
                continue
            members = tuple(sorted(group))
            if len(members) == 1:
                continue  # a collective over oneself moves nothing
            roles = self.roles.get(members)
            if roles is None:
                self.problems.append(f"{n} {kind} over ranks {list(members)}, which form no group of {self.layout}")
            elif kind == "all_to_all" and "ulysses" not in roles:
                self.problems.append(f"{n} all-to-all over the {'/'.join(roles)} group {list(members)}")
            elif kind == "all_reduce" and "tp" not in roles:
                self.problems.append(f"{n} all-reduce over the {'/'.join(roles)} group {list(members)}")


def check_counts(counts: Counts, layout: Layout) -> CheckResult:
    """`structure.collectives` for the rank that made `counts`, from its counts alone."""
    problems = _Rules(counts, layout, counts.rank).found()
    return CheckResult(CHECK_ID, Status.FAIL if problems else Status.PASS,
                       "; ".join(problems) if problems else counts.summary(), data=counts.to_json())
