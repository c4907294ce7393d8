"""Localization: where a failing parity check's difference arises, for every library.

Forward: `Recorder` keeps every module call's tensors (inputs and outputs, in execution order) on the
reference and on the parallel model; `gather_trace` puts the parallel side's shards back together by the
layout's groups (each adapter says which groups, which dims it prefers and which modules the plan keeps
whole); `compare_traces` holds each call to the reference and names the first call beyond tolerance, the
last one before it that agreed, and the module where the difference arises (`origin`: the innermost call
whose inputs agreed). Gradients: `grad_entry` per parameter, `grads_localization` sorts them and says the
pattern in one line (`pattern`). The pure parts (`sharding`, `compare_traces`, `pattern`, `fit_factor`)
take no process group and are tested in process.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import re
from dataclasses import dataclass, field

import torch

from paracheck.domain.localization import ForwardLocalization, GradRow, GradsLocalization, ModuleRow, Skipped

#: A parameter whose gradient is k x the reference's to this relative residual (max |a - k b| / max |b|) is
#: "off by k". A summary's word, not a check's bound: fp32 gradients that agree do so to ~1e-7.
FACTOR_FIT = 1e-3
#: How far a factor may be from a layout degree (or its inverse) and still be named after it.
DEGREE_MATCH = 1e-3
#: A reference gradient no larger than this fraction of atol is zero at the tolerance: a factor of up to 1 / it
#: leaves it within, so it witnesses no factor (a key projection's bias, whose gradient softmax makes 0 up to
#: rounding, 1e-9 on the GPT-2 example).
NEGLIGIBLE = 1e-2


def enabled() -> bool:
    """Whether a failing case is localized on this rank: always, unless the run says `PARACHECK_LOCALIZE=0` (one of
    `launch.protocol.RUN_SWITCHES`: every rank of a world applies the launcher's, so all decide alike); the
    benchmark of what localization costs (`benchmarks/localize_cost.py`) runs both ways."""
    return os.environ.get("PARACHECK_LOCALIZE", "1") != "0"


# -- recording ------------------------------------------------------------------------------------


@dataclass
class Call:
    """One module call: its key (`name`, or `name#k` for its k-th call), when it began and ended on one
    counter (so enclosing calls are known), and the tensors it took and gave."""
    key: str
    name: str
    start: int
    end: int = -1
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    #: What each input was passed as: its position ("0") or keyword, then ".i" for the i-th tensor inside it.
    input_names: list = field(default_factory=list)


def tensors_of(value, depth: int = 0) -> list[torch.Tensor]:
    """The tensors in a module's arguments or output, in a fixed order (tuples, lists, dicts, output
    dataclasses); complex tensors as their real view, so shapes and comparisons stay real."""
    if isinstance(value, torch.Tensor):
        return [torch.view_as_real(value) if value.is_complex() else value]
    if depth > 3:
        return []
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_of(v, depth + 1)]
    if isinstance(value, dict):
        return [t for k in value for t in tensors_of(value[k], depth + 1)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for f in dataclasses.fields(value) for t in tensors_of(getattr(value, f.name), depth + 1)]
    return []


class Recorder:
    """Forward hooks on every module of `model` while the `with` block runs; `calls` in execution order
    (by when each call ended). `local` turns a tensor into this rank's plain tensor, inside the hook
    (a DTensor's `full_tensor()` is a collective: every rank of its mesh reaches the same hook in order).
    `names`: the modules to record, by `named_modules` name -> the name to record them under (an adapter that
    reads names through wrappers leaves the wrappers out); every module by its own name without it."""

    def __init__(self, model: torch.nn.Module, local=None, names: dict | None = None):
        self.model, self.local = model, local or (lambda t: t)
        self.names = names
        self.calls: list[Call] = []
        self._open: dict[int, list[Call]] = {}
        self._seen: dict[str, int] = {}
        self._clock = 0
        self._handles = []

    def __enter__(self):
        for name, module in self._modules():
            self._handles.append(module.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post(name), with_kwargs=True))
        return self

    def _modules(self) -> list[tuple[str, torch.nn.Module]]:
        """(the name to record under, the module) for each module recorded."""
        named = self.model.named_modules()
        if self.names is None:
            return list(named)
        return [(self.names[raw], module) for raw, module in named if raw in self.names]

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _keep(self, value) -> list[torch.Tensor]:
        return [self.local(t).detach().clone() for t in tensors_of(value)]

    def _pre(self, name: str):
        name = name or "<root>"

        def hook(module, args, kwargs):
            count = self._seen.get(name, 0)
            self._seen[name] = count + 1
            labelled = [(str(i), a) for i, a in enumerate(args)] + [(k, kwargs[k]) for k in sorted(kwargs)]
            names = [label if len(tensors_of(v)) == 1 else f"{label}.{j}"
                     for label, v in labelled for j in range(len(tensors_of(v)))]
            call = Call(name if count == 0 else f"{name}#{count + 1}", name, self._tick(),
                        inputs=self._keep([v for _, v in labelled]), input_names=names)
            self._open.setdefault(id(module), []).append(call)
        return hook

    def _post(self, name: str):
        name = name or "<root>"

        def hook(module, args, kwargs, output):
            call = self._open[id(module)].pop()
            call.end, call.outputs = self._tick(), self._keep(output)
            self.calls.append(call)
        return hook

    def _tick(self) -> int:
        self._clock += 1
        return self._clock


class BackwardRecorder(Recorder):
    """Backward hooks on every module of `model` while the `with` block runs: each call, in the order the
    backward reaches it, with the gradient it received (grad wrt its outputs, as `inputs`) and the one it
    passed on (grad wrt its inputs, as `outputs`; none where no input requires grad)."""

    def __enter__(self):
        for name, module in self._modules():
            self._handles.append(module.register_full_backward_pre_hook(self._bpre(name or "<root>")))
            self._handles.append(module.register_full_backward_hook(self._bpost(name or "<root>")))
        return self

    def _bpre(self, name: str):
        def hook(module, grad_output):
            count = self._seen.get(name, 0)
            self._seen[name] = count + 1
            call = Call(name if count == 0 else f"{name}#{count + 1}", name, self._tick(),
                        inputs=self._keep([g for g in grad_output if g is not None]))
            self._open.setdefault(id(module), []).append(call)
        return hook

    def _bpost(self, name: str):
        def hook(module, grad_input, grad_output):
            call = self._open[id(module)].pop()
            call.end, call.outputs = self._tick(), self._keep([g for g in grad_input if g is not None])
            self.calls.append(call)
        return hook


# -- putting shards back together ---------------------------------------------------------------


@dataclass(frozen=True)
class Group:
    """One kind of parallelism the parallel side's tensors may be split over: its label, the world's
    partition into its groups (lists of global ranks, each in the order its pieces concatenate), this
    rank's process group, and the dims a split along it is read on first."""
    label: str
    partition: tuple
    process_group: object
    prefer: tuple = ()
    #: Per-rank lengths of the tensors the plan splits separately along this group, which a model may
    #: concatenate on each rank (a joint text + image sequence): such a tensor's pieces are read segment
    #: by segment when the plain concatenation does not agree (`segment_readings`).
    segments: tuple = ()

    def members(self, rank: int) -> tuple:
        return next(tuple(g) for g in self.partition if rank in g)


#: A slot of `_gather_plan` for a call whose sides passed different numbers of tensors.
MISMATCH = ("mismatch",)


def sharding(ref_shape: tuple, shapes: dict, groups: list[tuple[str, tuple, tuple]],
             fixed: dict | None = None) -> tuple | str:
    """How the ranks hold one tensor whose whole shape is `ref_shape`: a dim (or None) per group label,
    in the order of `groups`, such that concatenating along them, group by group, gives every rank the
    whole shape; or a string saying why no such reading exists. `shapes`: rank -> its shape (ranks
    without the tensor absent); `groups`: (label, partition, preferred dims); `fixed`: label -> the one dim
    (or None) the plan declares for that group, the only reading tried for it. Pure: every rank decides
    the same from the same table, so every rank joins the same gathers."""
    ref_shape = tuple(ref_shape)
    if all(tuple(s) == ref_shape for s in shapes.values()):
        return tuple(None for _ in groups)
    if any(len(s) != len(ref_shape) for s in shapes.values()):
        return f"its rank {len(next(iter(shapes.values())))} shape is not the reference's {ref_shape}"
    present = set(shapes)
    for label, partition, _ in groups:
        for g in partition:
            if present & set(g) and not set(g) <= present:
                return f"not recorded on every rank of its {label} group {list(g)}"
    for dims in _candidates(len(ref_shape), groups, fixed or {}):
        if _reaches(ref_shape, {r: tuple(s) for r, s in shapes.items()}, groups, dims):
            return dims
    sizes = sorted({tuple(s) for s in shapes.values()})
    declared = "".join(f" (the plan declares {label} {'whole' if d is None else f'split on dim {d}'})"
                       for label, d in (fixed or {}).items())
    return f"local shapes {', '.join(map(str, sizes))} are no split of the reference's {ref_shape} over " \
           f"{', '.join(label for label, _, _ in groups) or 'no group'}{declared}"


def _candidates(rank: int, groups, fixed: dict) -> list[tuple]:
    """Every assignment of a dim (or None) to each group, the preferred dims first; a group in `fixed` gets
    its declared dim only."""
    per_group = []
    for label, _, prefer in groups:
        if label in fixed:
            dim = fixed[label]
            per_group.append([None] if dim is None else [dim % rank] if -rank <= dim < rank else [])
            continue
        dims = [d % rank for d in prefer if -rank <= d < rank]
        per_group.append([None] + list(dict.fromkeys(dims + list(range(rank)))))
    combos = list(itertools.product(*per_group))
    return sorted(combos, key=lambda c: sum(opts.index(d) for opts, d in zip(per_group, c)))


def _reaches(ref_shape: tuple, shapes: dict, groups, dims: tuple) -> bool:
    for (_, partition, _), dim in zip(groups, dims):
        if dim is None:
            continue
        merged = {}
        for g in partition:
            members = [r for r in g if r in shapes]
            if not members:
                continue
            pieces = [shapes[r] for r in members]
            if any(p[:dim] + p[dim + 1:] != pieces[0][:dim] + pieces[0][dim + 1:] for p in pieces):
                return False
            whole = pieces[0][:dim] + (sum(p[dim] for p in pieces),) + pieces[0][dim + 1:]
            merged.update(dict.fromkeys(members, whole))
        shapes = merged
    return all(s == ref_shape for s in shapes.values())


def gather_trace(calls: list[Call], ref_calls: list[Call], groups: list[Group], whole: set,
                 all_gather_object, rank: int, partial: bool = False,
                 declared: dict | None = None) -> tuple[dict, list[Skipped]]:
    """The parallel trace with every split tensor put back together: key -> [(slot side, index, whole tensor,
    other readings)], and the calls not compared (with why). `whole`: module names the plan keeps whole
    (their outputs are compared as the rank holds them: a gather point that did not gather shows as a
    shape). `partial`: a tensor the ranks hold whole may be each rank's share of a sum (a gradient of a
    tensor every rank computed whole, each from its own slice), so its sum over each group, and over all of
    them, are other readings. `declared`: (module name, "in"|"out") -> per tensor, {group label: dim or None},
    where the plan says how a module's local tensors are split (`sharding`'s `fixed`). Collectives: one object gather over the world (every rank's shapes), then one
    tensor gather per group (and with `partial` one all-reduce per group and reading), on every rank in the
    same order."""
    ref = {c.key: c for c in ref_calls}
    table = all_gather_object([(c.key, [tuple(t.shape) for t in c.inputs], [tuple(t.shape) for t in c.outputs])
                               for c in calls])
    plan, not_compared = _gather_plan(table, ref, groups, whole, declared or {})
    mismatched = {slot for slot, dims in plan.items() if dims is MISMATCH}
    plan = {slot: dims for slot, dims in plan.items() if dims is not MISMATCH}
    mine = {c.key: c for c in calls}
    # Every slot holds its readings so far, (label, tensor), the plain one first; a split read back segment
    # by segment adds readings, carried through the next group's gather (a packed TP shard of a joint sequence).
    held = {(key, side, i): [("", (mine[key].inputs if side == "in" else mine[key].outputs)[i])]
            for key, side, i in plan if key in mine}
    uniform = {slot for slot in held if len({_held_shape(table, r, slot) for r in range(len(table))}) == 1}
    for index, group in enumerate(groups):
        wanted = {slot: dims[index] for slot, dims in plan.items() if dims[index] is not None and slot in held}
        if wanted:
            held.update(_gather_group(held, wanted, group, table, plan, groups[:index], uniform))
    if partial and groups:
        unsplit = sorted(slot for slot, dims in plan.items() if slot in held and all(d is None for d in dims))
        for label, summed in _sums({slot: held[slot][0][1] for slot in unsplit}, unsplit, groups):
            for slot, tensor in summed.items():
                held[slot].append((label, tensor))
    out = {}
    for key, call in mine.items():
        if key in ref:
            out[key] = [(side, i, held[(key, side, i)][0][1], held[(key, side, i)][1:])
                        for side, tensors in (("in", call.inputs), ("out", call.outputs))
                        for i in range(len(tensors)) if (key, side, i) in held]
            out[key] += [(side, -1, None, []) for k, side, _ in mismatched if k == key]
    return out, not_compared


def _held_shape(table: list, rank: int, slot: tuple):
    key, side, i = slot
    entry = next((e for e in table[rank] if e[0] == key), None)
    return None if entry is None else tuple(entry[1 if side == "in" else 2][i])


def _sums(held: dict, slots: list, groups: list[Group]) -> list[tuple[str, dict]]:
    """The slots summed over each group, then over all groups (one all-reduce of one buffer each)."""
    import torch.distributed as dist

    def summed(tensors: dict, group: Group) -> dict:
        flat = torch.cat([tensors[s].detach().to("cpu", torch.float64).reshape(-1) for s in slots]) if slots \
            else torch.zeros(0, dtype=torch.float64)
        dist.all_reduce(flat, group=group.process_group)
        return dict(zip(slots, _split(flat, [tuple(tensors[s].shape) for s in slots])))

    out = [(f"summed over {g.label}", summed(held, g)) for g in groups]
    if len(groups) > 1:
        every = held
        for g in groups:
            every = summed(every, g)
        out.append((f"summed over {' and '.join(g.label for g in groups)}", every))
    return out


def segment_readings(pieces: list[torch.Tensor], dim: int, segments: tuple) -> list[tuple[str, torch.Tensor]]:
    """Other readings of a tensor gathered along `dim` from `pieces` (one per rank, in group order): each
    piece as separately split tensors laid end to end (two or three of the lengths in `segments`, or one of its
    tuples: an exact order of lengths), each segment's pieces concatenated over the ranks, then the segments
    (pure)."""
    if not segments or not pieces:
        return []
    length, out, seen = pieces[0].shape[dim], [], set()
    lengths = [n for n in segments if isinstance(n, int)]
    # A tuple in `segments` is one exact order (a packed projection's blocks); lengths are tried in twos and threes.
    orders = [tuple(n) for n in segments if isinstance(n, tuple)]
    orders += [o for r in (2, 3) for o in itertools.product(lengths, repeat=r)]
    for order in orders:
        if sum(order) != length or order in seen or any(p.shape[dim] != length for p in pieces):
            continue
        seen.add(order)
        offsets = [sum(order[:j]) for j in range(len(order))]
        parts = [torch.cat([p.narrow(dim, o, n) for p in pieces], dim=dim) for o, n in zip(offsets, order)]
        out.append((f"segments {order} per rank", torch.cat(parts, dim=dim)))
    return out


def _gather_plan(table: list, ref: dict, groups: list[Group], whole: set,
                 declared: dict) -> tuple[dict, list[Skipped]]:
    """(key, "in"|"out", index) -> dims per group, for every slot both sides hold; and the calls not compared."""
    per_key: dict[str, dict[int, tuple]] = {}
    for r, entries in enumerate(table):
        for key, ins, outs in entries:
            per_key.setdefault(key, {})[r] = (ins, outs)
    specs = [(g.label, g.partition, g.prefer) for g in groups]
    plan, not_compared = {}, []
    for key, by_rank in per_key.items():
        if key not in ref:
            not_compared.append(Skipped(key, "on the parallel model only"))
            continue
        why = []
        for side, position in (("in", 0), ("out", 1)):
            ref_tensors = ref[key].inputs if side == "in" else ref[key].outputs
            counts = {len(v[position]) for v in by_rank.values()}
            if counts != {len(ref_tensors)}:
                why.append(f"{'takes' if side == 'in' else 'gives'} {sorted(counts)} tensors, the reference "
                           f"{len(ref_tensors)}")
                # Called with other arguments than the reference: its inputs differ (the origin is further out).
                plan[(key, side, -1)] = MISMATCH
                continue
            fixed = declared.get((ref[key].name, side), ())
            for i, want in enumerate(ref_tensors):
                if side == "out" and ref[key].name in whole:
                    plan[(key, side, i)] = tuple(None for _ in groups)
                    continue
                dims = sharding(tuple(want.shape), {r: v[position][i] for r, v in by_rank.items()}, specs,
                                fixed[i] if i < len(fixed) else None)
                if isinstance(dims, str):
                    why.append(f"{'input' if side == 'in' else 'output'} {i}: {dims}")
                else:
                    plan[(key, side, i)] = dims
        if why:
            not_compared.append(Skipped(key, "; ".join(why)))
    seen = set(per_key)
    not_compared += [Skipped(key, "on the reference only") for key in ref if key not in seen]
    return plan, not_compared


def _gather_group(held: dict, wanted: dict, group: Group, table: list, plan: dict, done: list[Group],
                  uniform: set) -> dict:
    """One all-gather over this rank's `group` moves every reading of every slot split along it (padded to
    the longest rank's share); each is concatenated along its dim in the group's order, and where every rank
    holds the slot in one shape, also read segment by segment (`segment_readings`), so every group of the
    partition makes the same number of readings."""
    import torch.distributed as dist

    # The pieces come back in the process group's own rank order, which is the order they concatenate in.
    members = tuple(dist.get_process_group_ranks(group.process_group))
    slots = sorted(wanted)
    counts = [len(held[slot]) for slot in slots]
    shapes = {r: [_shape_after(table, r, slot, plan, done) for slot, n in zip(slots, counts) for _ in range(n)]
              for r in members}
    longest = max(sum(math.prod(s) for s in shapes[r]) for r in members)
    flat = torch.zeros(longest, dtype=torch.float64)
    if slots:
        mine = torch.cat([t.detach().to("cpu", torch.float64).reshape(-1) for slot in slots for _, t in held[slot]])
        flat[:mine.numel()] = mine
    pieces = [torch.empty_like(flat) for _ in members]
    dist.all_gather(pieces, flat, group=group.process_group)
    per_rank = {r: _split(p, shapes[r]) for r, p in zip(members, pieces)}
    out, at = {}, 0
    for slot, n in zip(slots, counts):
        dim, readings = wanted[slot], []
        for j, (label, _) in enumerate(held[slot]):
            parts = [per_rank[r][at + j] for r in members]
            readings.append((label, torch.cat(parts, dim=dim)))
            if slot in uniform:
                readings += [(f"{label}; {seg}" if label else seg, t)
                             for seg, t in segment_readings(parts, dim, group.segments)]
        at += n
        # The plain reading first: `compare_calls` tries the others only where it does not agree.
        out[slot] = readings[:1] + [r for r in readings[1:]]
    return out


def _shape_after(table: list, rank: int, slot: tuple, plan: dict, done: list[Group]) -> tuple:
    """The shape `rank` holds `slot` in after the groups of `done` were gathered."""
    key, side, i = slot
    entry = next(e for e in table[rank] if e[0] == key)
    shape = tuple(entry[1 if side == "in" else 2][i])
    for index, group in enumerate(done):
        dim = plan[slot][index]
        if dim is not None:
            members = group.members(rank)
            shape = shape[:dim] + (sum(_shape_after(table, r, slot, plan, done[:index])[dim] for r in members),) + \
                shape[dim + 1:]
    return shape


def _split(flat: torch.Tensor, shapes: list) -> list[torch.Tensor]:
    out, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(flat[offset:offset + n].view(shape))
        offset += n
    return out


# -- comparing two traces ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Error:
    """One tensor's (or call's) difference: the largest |a - b|, that over max |b|, and whether every
    element is within atol + rtol |b|; `why` when it could not be compared as numbers (shape, non-finite)."""
    max_abs: float | None
    max_rel: float | None
    within: bool
    why: str = ""
    #: The reading the tensor agreed under, when not the plain concatenation (`segment_readings`).
    reading: str = ""


def error(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> Error:
    if tuple(actual.shape) != tuple(expected.shape):
        return Error(None, None, False, f"shape {tuple(actual.shape)} != reference {tuple(expected.shape)}")
    a, b = actual.detach().double().cpu(), expected.detach().double().cpu()
    if a.numel() == 0:
        return Error(0.0, 0.0, True)
    if not torch.isfinite(a).all() and torch.isfinite(b).all():
        return Error(None, None, False, "non-finite values")
    diff = (a - b).abs().nan_to_num(0.0)
    max_abs = float(diff.max())
    return Error(max_abs, max_abs / max(float(b.abs().nan_to_num(0.0).max()), 1e-12),
                 bool((diff <= atol + rtol * b.abs()).all()))


def _worst(errors: list[Error]) -> Error:
    if not errors:
        return Error(0.0, 0.0, True)
    figures = [e for e in errors if e.max_abs is not None]
    why = "; ".join(e.why for e in errors if e.why)
    reading = "; ".join(dict.fromkeys(e.reading for e in errors if e.reading))
    return Error(max((e.max_abs for e in figures), default=None), max((e.max_rel for e in figures), default=None),
                 all(e.within for e in errors), why, reading)


@dataclass(frozen=True)
class TraceEntry:
    """One compared call: its key, module name, when it began and ended, and its inputs' and outputs' errors."""
    key: str
    name: str
    start: int
    end: int
    inputs: Error
    outputs: Error


def compare_calls(gathered: dict, ref_calls: list[Call], atol: float, rtol: float) -> list[TraceEntry]:
    """Each call both sides made, in the reference's execution order, with its errors. A tensor with other
    readings (`segment_readings`) takes the first that agrees where the plain one does not."""
    entries = []
    for call in ref_calls:
        if call.key not in gathered:
            continue
        errors = {"in": [], "out": []}
        for side, i, tensor, others in gathered[call.key]:
            if tensor is None:  # the sides passed a different number of tensors
                errors[side].append(Error(None, None, False, "another number of tensors than the reference's"))
                continue
            want = (call.inputs if side == "in" else call.outputs)[i]
            found = error(tensor, want, atol, rtol)
            if not found.within:
                found = next((dataclasses.replace(e, reading=label) for e, label in
                              ((error(t, want, atol, rtol), label) for label, t in others) if e.within), found)
            errors[side].append(found)
        if errors["out"] or errors["in"]:
            # A call that gave nothing to compare (a backward whose inputs need no gradient) agrees on it.
            entries.append(TraceEntry(call.key, call.name, call.start, call.end, _worst(errors["in"]),
                                      _worst(errors["out"])))
    return entries


def compare_traces(entries: list[TraceEntry]) -> ForwardLocalization:
    """The localization of one pass from its compared calls (pure): every call in execution order, the first
    whose output is beyond tolerance, the last before it that agreed, and `origin`: from the first, the
    innermost enclosing call whose inputs agreed (a module whose inputs already differ only carries a
    difference that arose in its caller, between module calls)."""
    modules = tuple(row(e) for e in entries)
    first = next((e for e in entries if not e.outputs.within), None)
    if first is None:
        return ForwardLocalization(modules)
    before = [e for e in entries if e.end < first.end and e.outputs.within]
    origin = first
    while not origin.inputs.within:
        parent = _enclosing(origin, entries)
        if parent is None:
            break
        origin = parent
    return ForwardLocalization(modules, row(first), row(before[-1]) if before else None, origin.key)


def _enclosing(entry: TraceEntry, entries: list[TraceEntry]) -> TraceEntry | None:
    """The innermost call around `entry`: by time, else (a backward through modules whose inputs need no
    gradient is not nested in time) the nearest ancestor module by name."""
    around = [e for e in entries if e.start < entry.start and e.end > entry.end]
    if around:
        return max(around, key=lambda e: e.start)
    ancestors = [e for e in entries if e.name != entry.name and
                 (e.name == "<root>" or entry.name.startswith(e.name + "."))]
    return max(ancestors, key=lambda e: (e.name != "<root>", len(e.name))) if ancestors else None


def row(e: TraceEntry, stage: int | None = None) -> ModuleRow:
    """A compared call's row in a localization: its output's figures."""
    return ModuleRow(e.key, e.outputs.max_abs, e.outputs.max_rel, e.outputs.within, e.outputs.why,
                     e.outputs.reading, stage)


def forward_localization(calls: list[Call], ref_calls: list[Call], groups: list[Group], whole: set,
                         atol: float, rtol: float, all_gather_object, rank: int, partial: bool = False,
                         declared: dict | None = None) -> ForwardLocalization:
    """The localization of one pass (a forward, or a backward's trace), from both sides' recorded calls
    (collective; `partial` and `declared` as in `gather_trace`)."""
    gathered, not_compared = gather_trace(calls, ref_calls, groups, whole, all_gather_object, rank, partial,
                                          declared)
    found = compare_traces(compare_calls(gathered, ref_calls, atol, rtol))
    return dataclasses.replace(found, not_compared=tuple(not_compared), atol=atol, rtol=rtol)


def summary(found: ForwardLocalization) -> str:
    """One line for a report: where the difference arises, and what agreed last."""
    first = found.first
    if not first:
        return "no module's output differs beyond tolerance on the rerun"
    figures = f"max_abs {first.max_abs:.2e}" if first.max_abs is not None else first.why
    text = f"first module beyond tolerance: {first.module} ({figures})"
    if found.origin and found.origin != first.module:
        text += f", arising in {found.origin} (its inputs agree)"
    last = found.last_agreeing
    return text + (f"; last agreeing: {last.module}" if last else "; no module agreed before it")


# -- gradients ----------------------------------------------------------------------------------


def fit_factor(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float] | None:
    """(k, residual): the least-squares k with actual ~ k x expected, and max |actual - k expected| / max
    |expected|; None where the reference is zero or the shapes differ."""
    if tuple(actual.shape) != tuple(expected.shape):
        return None
    a, b = actual.detach().double().cpu().reshape(-1), expected.detach().double().cpu().reshape(-1)
    scale = float(b.abs().max()) if b.numel() else 0.0
    if scale == 0.0 or not torch.isfinite(a).all():
        return None
    k = float((a * b).sum() / (b * b).sum())
    return k, float((a - k * b).abs().max()) / scale


def grad_entry(name: str, actual, expected, atol: float, rtol: float) -> GradRow:
    """One parameter's gradient error: max_abs, max_rel, `over` (the largest |a - b| / (atol + rtol |b|):
    above 1 is beyond tolerance; None, infinitely beyond, where there is no figure), `within`, and the factor it
    is off by where one fits."""
    if actual is None or expected is None:
        missing = "no gradient" if actual is None else "a gradient the reference lacks"
        return GradRow(name, None, None, False, None, missing)
    e = error(actual, expected, atol, rtol)
    if e.why:
        return GradRow(name, e.max_abs, e.max_rel, e.within, None, e.why)
    a, b = actual.detach().double().cpu(), expected.detach().double().cpu()
    over = float(((a - b).abs() / (atol + rtol * b.abs())).max()) if b.numel() else 0.0
    over = None if over == math.inf else over  # JSON-safe: no infinity
    fit = fit_factor(a, b)
    factor = fit[0] if not e.within and fit is not None and fit[1] <= FACTOR_FIT else None
    # A reference gradient zero at the tolerance: no factor can move it, not counted in "every gradient".
    zero = not b.numel() or float(b.abs().max()) <= NEGLIGIBLE * atol
    return GradRow(name, e.max_abs, e.max_rel, e.within, over, "", factor, zero)


def grads_localization(entries: list[GradRow], degrees: dict) -> GradsLocalization:
    """Every parameter's entry, furthest beyond tolerance first, the one-line pattern, and `origin` (see
    `grads_origin`; an adapter that traces the backward replaces it with the trace's)."""
    ranked = sorted(entries, key=lambda e: (-e.beyond, e.param))
    return GradsLocalization(tuple(ranked), pattern(ranked, degrees), grads_origin(ranked))


def grads_origin(ranked: list[GradRow]) -> str | None:
    """Where the gradient error enters, as far as the table tells (pure): the model's output ("<root>")
    when every gradient is off (a scaled output gradient, a loss factor, a reduction left out), else the
    parameter furthest beyond tolerance; None when none is."""
    off = [e for e in ranked if not e.within]
    if not off:
        return None
    return "<root>" if len(off) == _movable(ranked) else off[0].param


def _movable(entries: list[GradRow]) -> int:
    """How many gradients a wrong factor would move (a zero reference gradient stays zero)."""
    return sum(1 for e in entries if not e.reference_zero or not e.within)


def pattern(entries: list[GradRow], degrees: dict) -> str:
    """Which gradients are exact and which are off, and by what factor, in one line (pure): e.g.
    "layers.*.self_attn.q_norm.weight, layers.*.self_attn.k_norm.weight off by 2.0 = tp; everything else
    exact". `degrees`: the layout's degrees by name, to name a factor after one."""
    off = [e for e in entries if not e.within]
    if not off:
        return "every gradient within tolerance"
    parts = []
    groups: dict[tuple, list[GradRow]] = {}
    for e in off:
        key = ("why", e.why) if e.why else ("factor", _round(e.factor))
        groups.setdefault(key, []).append(e)
    for (kind, value), group in sorted(groups.items(), key=lambda kv: (kv[0][1] is None, kv[0][0], -len(kv[1]))):
        names = "every gradient" if len(group) == _movable(entries) else _names([e.param for e in group])
        if kind == "why":
            parts.append(f"{names}: {value}")
        elif value is None:
            parts.append(f"{names} off with no common factor")
        else:
            parts.append(f"{names} off by {value:g}{_degree_name(value, degrees)}")
    exact = len(entries) - len(off)
    if exact and len(off) < _movable(entries):
        parts.append("everything else exact")
    elif exact:
        parts.append(f"the {exact} whose reference gradient is zero stay zero")
    return "; ".join(parts)


def _round(factor: float | None) -> float | None:
    return None if factor is None else float(f"{factor:.3g}")


def _degree_name(factor: float, degrees: dict) -> str:
    if abs(factor) < DEGREE_MATCH:
        return " (zero)"
    names = [name for name, d in degrees.items() if d > 1 and abs(factor - d) <= DEGREE_MATCH * d]
    names += [f"1/{name}" for name, d in degrees.items() if d > 1 and abs(factor - 1 / d) <= DEGREE_MATCH / d]
    return f" = {' = '.join(names)}" if names else ""


def _names(params: list[str], limit: int = 3) -> str:
    """Parameter names with block indices folded (`layers.*.x`), the first `limit`, and how many more."""
    folded = list(dict.fromkeys(re.sub(r"\.\d+\.", ".*.", p) for p in params))
    more = f" (+{len(folded) - limit} more)" if len(folded) > limit else ""
    return ", ".join(folded[:limit]) + more


def local_share(tensor):
    """This rank's share of a DTensor, put together later by the layout's groups (a packed projection's shards are
    laid out block by block, which `full_tensor()` would concatenate in the wrong order); a pending reduction
    (Partial) is reduced here. A plain tensor as is."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor
    if any(p.is_partial() for p in tensor.placements):
        return tensor.full_tensor()
    return tensor.to_local()


def all_gather_object(obj) -> list:
    """Every rank's `obj`, in rank order (how a trace's shapes are exchanged)."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out

