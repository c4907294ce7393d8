"""Collectives as structure: which collectives one forward issues on a rank, and over which process group.

`CollectiveCounter` is a `TorchDispatchMode` that records every collective dispatched inside it, keyed by
its kind and the ranks of the process group it ran over. Like torch's `CommDebugMode` it returns
`NotImplemented` for DTensor ops, so DTensor desugars first and the counter sees the collectives of TP's
redistributions; it sees diffusers' Ulysses all-to-alls and the CP hooks' gathers directly, since those
are functional collectives (`torch.ops._c10d_functional`). Unlike `CommDebugMode` it records the group.
It also counts the calls of the attention modules, so the verdict can ask for collectives per attention call.

`verdict` is pure: counts in, one `CheckResult` out (`structure.collectives`). The rules:

- Ulysses (ulysses > 1): every attention call issues at least one all-to-all over this rank's Ulysses group.
- Ring (ring > 1): every attention call gathers (or rotates) the KV over this rank's ring group.
- CP (cp > 1): the output is gathered over the CP group (the `cp_output` hook); a CP layout whose forward
  issues no CP collective at all fails.
- TP (tp > 1): TP's all-reduces run over this rank's TP group, and at least one runs.
- No layout: an all-to-all or all-reduce over any other group, or any collective over ranks that form
  no group of the layout, fails.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

from .layout import Layout
from .records import CheckId, CheckResult, Status

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


@dataclass
class Counts:
    """One rank's collectives: (kind, group ranks) -> how many; and how many attention calls ran."""

    rank: int
    ops: Counter = field(default_factory=Counter)
    attention_calls: int = 0
    #: op names seen that have no kind here (reported, never counted as a kind)
    unknown: Counter = field(default_factory=Counter)

    def count(self, kind: str, group: tuple[int, ...] | None = None) -> int:
        return sum(n for (k, g), n in self.ops.items() if k == kind and (group is None or g == group))

    def to_json(self) -> dict:
        return {
            "rank": self.rank,
            "attention_calls": self.attention_calls,
            "ops": [{"kind": k, "group": list(g) if g is not None else None, "count": n}
                    for (k, g), n in sorted(self.ops.items(), key=lambda i: (i[0][0], i[0][1] or ()))],
            "unknown": dict(self.unknown),
        }

    @classmethod
    def from_json(cls, data: dict) -> "Counts":
        ops = Counter({(o["kind"], tuple(o["group"]) if o["group"] is not None else None): o["count"]
                       for o in data["ops"]})
        return cls(data["rank"], ops, data.get("attention_calls", 0), Counter(data.get("unknown", {})))

    def summary(self) -> str:
        return ", ".join(f"{n} {k} over {list(g) if g else '?'}" for (k, g), n in sorted(
            self.ops.items(), key=lambda i: (i[0][0], i[0][1] or ()))) or "no collectives"


def _group_ranks(value) -> tuple[int, ...] | None:
    import torch.distributed as dist

    try:
        if isinstance(value, str):
            from torch.distributed.distributed_c10d import _resolve_process_group

            value = _resolve_process_group(value)
        if isinstance(value, dist.ProcessGroup):
            return tuple(dist.get_process_group_ranks(value))
    except Exception:
        return None
    return None


def _make_mode():
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Mode(TorchDispatchMode):
        def __init__(self, counts: Counts):
            super().__init__()
            self.counts = counts

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if isinstance(func, torch._ops.HigherOrderOperator):
                return func(*args, **kwargs)
            if any(t is DTensor or (isinstance(t, type) and issubclass(t, DTensor)) for t in types):
                return NotImplemented  # let DTensor desugar into the collectives we then see
            out = func(*args, **kwargs)
            if func.namespace in _NAMESPACES:
                self._record(func, args, kwargs)
            return out

        def _record(self, func, args, kwargs):
            name = func._schema.name.split("::")[-1]
            kind = _KINDS.get(name)
            if kind is None:
                if name not in ("wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier"):
                    self.counts.unknown[name] += 1
                return
            group = None
            for index, argument in enumerate(func._schema.arguments):
                if argument.name in _GROUP_ARGS:
                    value = kwargs.get(argument.name, args[index] if index < len(args) else None)
                    group = _group_ranks(value)
                    if group is not None:
                        break
            self.counts.ops[(kind, group)] += 1

    return _Mode


@contextlib.contextmanager
def count_collectives(model=None, rank: int | None = None):
    """Count the collectives dispatched inside the block (and, given `model`, its attention calls).

    Yields a `Counts`; read it after the block. Works in a real world and under the fake process group
    on the meta device (where the functional collectives run their meta kernels and move nothing).
    """
    import torch.distributed as dist

    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    counts = Counts(rank)
    handles = []
    if model is not None:
        for module in _attention_modules(model):
            handles.append(module.register_forward_pre_hook(_bump(counts)))
    mode = _make_mode()(counts)
    try:
        with mode:
            yield counts
    finally:
        for handle in handles:
            handle.remove()


def _bump(counts: Counts):
    def hook(module, args):
        counts.attention_calls += 1

    return hook


def _attention_modules(model) -> list:
    """Modules whose processor takes a parallel config: the ones that run (or would run) Ulysses/ring."""
    found = []
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_parallel_config"):
            found.append(module)
    return found


# -- verdict (pure) -----------------------------------------------------------------------------


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


def verdict(counts: Counts, layout: Layout, rank: int | None = None) -> CheckResult:
    """`structure.collectives` for one rank, from its counts alone."""
    rank = counts.rank if rank is None else rank
    groups = expected_groups(layout, rank)
    known: dict[tuple, list[str]] = {}
    for role, members in groups.items():
        known.setdefault(tuple(sorted(members)), []).append(role)
    calls = counts.attention_calls
    problems: list[str] = []

    def over(kind: str, role: str) -> int:
        members = tuple(sorted(groups[role]))
        return sum(n for (k, g), n in counts.ops.items() if k == kind and g is not None and tuple(sorted(g)) == members)

    ring_same_as_cp = layout.ring > 1 and layout.ulysses == 1
    cp_total = 0
    if layout.ulysses > 1:
        got = over("all_to_all", "ulysses")
        cp_total += got
        if got == 0:
            problems.append(f"no all-to-all over the Ulysses group {list(groups['ulysses'])}")
        elif calls and got < calls:
            problems.append(f"{got} all-to-alls over the Ulysses group for {calls} attention calls")
    gathered = over("all_gather", "cp") if layout.has_cp else 0
    if layout.ring > 1:
        rotated = over("permute", "ring") + over("send", "ring")
        if ring_same_as_cp:
            # Ring alone: one group carries the KV gathers and the output gather. Each attention call
            # gathers once; what is left over is the output's gather.
            need = calls or 1
            got = min(gathered, need) + rotated
            gathered = max(0, gathered - need)
        else:
            got = over("all_gather", "ring") + rotated
        cp_total += got
        if got == 0:
            problems.append(f"no KV gather/rotation over the ring group {list(groups['ring'])}")
        elif calls and got < calls:
            problems.append(f"{got} KV gathers over the ring group for {calls} attention calls")
    if layout.has_cp:
        cp_total += gathered
        if gathered == 0:
            problems.append(f"the output is not gathered over the CP group {list(groups['cp'])}")
        if cp_total == 0:
            problems.insert(0, "a CP layout issued no collective over its CP groups")
    if layout.tp > 1:
        got = over("all_reduce", "tp")
        if got == 0:
            problems.append(f"no all-reduce over the TP group {list(groups['tp'])}")

    for (kind, group), n in sorted(counts.ops.items(), key=lambda i: (i[0][0], i[0][1] or ())):
        if group is None:
            problems.append(f"{n} {kind} over an unknown group")
            continue
        members = tuple(sorted(group))
        if len(members) == 1:
            continue  # a collective over oneself moves nothing
        roles = known.get(members)
        if roles is None:
            problems.append(f"{n} {kind} over ranks {list(members)}, which form no group of {layout}")
        elif kind == "all_to_all" and "ulysses" not in roles:
            problems.append(f"{n} all-to-all over the {'/'.join(roles)} group {list(members)}")
        elif kind == "all_reduce" and "tp" not in roles:
            problems.append(f"{n} all-reduce over the {'/'.join(roles)} group {list(members)}")
    return CheckResult(CHECK_ID, Status.FAIL if problems else Status.PASS,
                       "; ".join(problems) if problems else counts.summary(), data=counts.to_json())
