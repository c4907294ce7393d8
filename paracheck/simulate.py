"""Simulated worlds: every rank of a large world, one after another, in one process, without hardware.

For each rank the simulation joins torch's fake process group (`backend="fake"`: collectives move nothing),
builds the model on the meta device, parallelizes it through the kit's own routes (`routes.apply`: the
library's `enable_parallelism`, or the shared mesh plus `apply_context_parallel` / `apply_tensor_parallel`),
and runs the structure checks on what the library really built:

- structure.mesh, structure.cp_hooks, structure.processor_config: the kit's own checks, unchanged.
- structure.tp_shards (meta): placements, mesh, local shape, and the shard *index*. Meta tensors hold no
  values, so `ShardLedger` carries indices instead: it follows every slice, split, cat and copy of a planned
  parameter, and knows which rows of the full parameter each local shard holds. Where torch scatters a
  shard (on meta the scatter moves nothing) the index is the one the DTensor's mesh coordinate implies.
- backend.groups: the backend's rules checked against the process groups the library built (Neuron: every
  all-to-all group contiguous and of size 4, 8, 16 or a multiple of 32).
- structure.collectives (opt-in): one forward on meta tensors, its collectives counted per group
  (see `collectives.py`). Ring attention runs diffusers' `_native_flash` backend there, whose meta kernel
  returns the log-sum-exp that native attention lacks.

What is reused across ranks: the imports, a pristine meta "template" model (the reference the controls
plant from), the TP shard specs, the meta inputs. What is not: the process group, the mesh and the model,
which every rank builds afresh (all three are cheap; see `LayoutResult.timings`).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import library
from .backends import Backend, get_backend
from .checks import CheckContext, check_cp_hooks, check_mesh, check_processor_config
from .controls import get_control
from .fitting import HEAD_DIM_KEY, HEADS_KEY, TIED_TO_INNER_DIM, Unfittable, cp_split_problems, fit_init_dict
from .layout import Layout, layouts_for
from .records import CheckId, CheckResult, Route, Status

MAX_WORLD = 128
ROUTES = ("auto", "native", "composed")
#: Check ids a simulated rank reports, in table order (plain strings: `backend.groups` is the simulation's own).
SIM_CHECKS = ("structure.mesh", "structure.cp_hooks", "structure.processor_config", "structure.tp_shards",
              "backend.groups", "structure.collectives")
BACKEND_GROUPS = "backend.groups"
APPLY = "simulate.apply"
_SHORT = {"structure.mesh": "mesh", "structure.cp_hooks": "hooks", "structure.processor_config": "procs",
          "structure.tp_shards": "shards", "backend.groups": "groups", "structure.collectives": "colls"}
NEURON_ALLTOALL_SIZES = (4, 8, 16)
#: The attention backend a ring layout's forward runs on meta (native attention returns no LSE).
RING_META_BACKEND = "_native_flash"


class SimulationError(ValueError):
    """Bad input to a simulation (the CLI turns it into exit 2)."""


# -- results ----------------------------------------------------------------------------------


@dataclass
class LayoutResult:
    layout: Layout
    #: ok | no (the backend cannot run it, or a check failed) | unfit (not simulated) | skip (control n/a)
    status: str
    reason: str = ""
    route: str = ""
    #: check id -> {"ranks": [...], "detail": first failing rank's detail}
    failures: dict = field(default_factory=dict)
    #: check ids that ran (on at least one rank) and passed on every rank
    passed: list = field(default_factory=list)
    skipped: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    ranks: int = 0
    seconds: float = 0.0
    #: CPU seconds of this process (the wall time swings with other jobs on a shared machine; this less)
    cpu_seconds: float = 0.0
    #: phase -> seconds summed over ranks: world (fake PG up/down), build, apply, checks, forward
    timings: dict = field(default_factory=dict)
    control: str | None = None
    #: with a control: whether one of its must-trip checks failed
    detected: bool | None = None
    #: per-rank collective counts (when counted), rank -> Counts.to_json()
    counts: dict = field(default_factory=dict)

    @property
    def per_rank(self) -> float:
        return self.seconds / self.ranks if self.ranks else 0.0

    @property
    def cpu_per_rank(self) -> float:
        return self.cpu_seconds / self.ranks if self.ranks else 0.0

    @property
    def structure_failed(self) -> bool:
        return any(check.startswith("structure.") or check == APPLY for check in self.failures)

    def to_json(self) -> dict:
        return {
            "layout": self.layout.name, "order": self.layout.order, "status": self.status, "reason": self.reason,
            "route": self.route, "failures": self.failures, "passed": self.passed, "skipped": self.skipped,
            "notes": self.notes, "ranks": self.ranks, "seconds": round(self.seconds, 3),
            "per_rank": round(self.per_rank, 4), "cpu_seconds": round(self.cpu_seconds, 3),
            "cpu_per_rank": round(self.cpu_per_rank, 4), "timings": {k: round(v, 3) for k, v in self.timings.items()},
            "control": self.control, "detected": self.detected,
        }


# -- model and inputs -------------------------------------------------------------------------


def with_heads(model_class: type, init_dict: dict, heads: int | None) -> dict:
    """`init_dict` with `num_attention_heads` set to `heads` (and what the model ties to heads x head_dim)."""
    from .fitting import _default

    if heads is None:
        return dict(init_dict)
    if heads < 1:
        raise SimulationError(f"--heads {heads}: must be >= 1")
    import inspect

    if HEADS_KEY not in inspect.signature(model_class.__init__).parameters:
        raise SimulationError(f"--heads {heads}: {model_class.__name__} takes no {HEADS_KEY}")
    out = dict(init_dict, **{HEADS_KEY: heads})
    head_dim = out.get(HEAD_DIM_KEY, _default(model_class, HEAD_DIM_KEY))
    for key in TIED_TO_INNER_DIM.get(model_class.__name__, ()):
        if isinstance(head_dim, int):
            out[key] = heads * head_dim
    return out


def heads_of(model_class: type, init_dict: dict):
    from .fitting import _default

    return init_dict.get(HEADS_KEY, _default(model_class, HEADS_KEY))


#: Modules whose `reset_parameters` `build_meta` skips: on meta an initializer writes nothing anyway, and
#: skipping them builds full-size Flux about 2.5x faster (measured: 0.27 s -> 0.10 s).
_INITIALIZED = ("Linear", "Conv1d", "Conv2d", "Conv3d", "Embedding", "LayerNorm", "RMSNorm", "GroupNorm")


def build_meta(model_class: type, init_dict: dict):
    """The model on the meta device, no initializers run (there are no values to initialize)."""
    saved = {}
    for name in _INITIALIZED:
        module = getattr(torch.nn, name, None)
        if module is not None and "reset_parameters" in vars(module):
            saved[module] = module.reset_parameters
            module.reset_parameters = _no_init
    try:
        with torch.device("meta"):
            return model_class(**init_dict).eval()
    finally:
        for module, method in saved.items():
            module.reset_parameters = method


def _no_init(self):
    return None


def meta_inputs(inputs: dict) -> dict:
    return {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in (inputs or {}).items()}


# -- the fake world ---------------------------------------------------------------------------


@contextlib.contextmanager
def fake_world(rank: int, world: int):
    """This process as `rank` of `world` under torch's fake process group; torn down on exit."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers backend "fake"

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized; a simulation needs the process to itself")
    _forget_meshes()
    hook = sys.excepthook  # init_process_group wraps it with a "[rankN]" prefix, once per simulated rank
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook
        _forget_meshes()


def _forget_meshes():
    """Clear DTensor's sharding-propagation caches. Their keys compare meshes by shape and dim names only,
    so without this a rank's DTensors come back holding the *previous* simulated rank's mesh (measured:
    on rank 1 of tp4xu4, every TP parameter's `device_mesh.get_coordinate()` read rank 0's)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    propagator = DTensor._op_dispatcher.sharding_propagator
    cached = getattr(propagator, "_propagate_tensor_meta_cached", None)
    if hasattr(cached, "cache_clear"):
        cached.cache_clear()


@contextlib.contextmanager
def _quiet():
    """diffusers warns once per `enable_parallelism` (every rank), funcol warns of a deprecation per gather."""
    logger = logging.getLogger("diffusers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


# -- shard ledger: indices instead of values --------------------------------------------------


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


def _merge(intervals) -> tuple:
    out: list[list[int]] = []
    for start, length in intervals:
        if length <= 0:
            continue
        if out and out[-1][0] + out[-1][1] == start:
            out[-1][1] += length
        else:
            out.append([start, length])
    return tuple((s, n) for s, n in out)


def _sub(intervals, start: int, stop: int) -> tuple:
    """Rows [start, stop) of the concatenation of `intervals`."""
    out, position = [], 0
    for begin, length in intervals:
        lo, hi = max(start, position), min(stop, position + length)
        if lo < hi:
            out.append((begin + lo - position, hi - lo))
        position += length
    return _merge(out)


def _ledger_mode():
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
                writes = self._writes.get(func)
                if writes is None:
                    writes = self._writes[func] = tuple(
                        i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write)
                for index in writes:
                    if index < len(args) and isinstance(args[index], torch.Tensor):
                        self._write(args[index], None)
                return out
            try:
                self._follow(func, args, kwargs, out)
            except Exception:  # the ledger must never break the library's code path
                pass
            return out

        def _get(self, value):
            return self.prov.get(value) if isinstance(value, torch.Tensor) else None

        def _follow(self, func, args, kwargs, out):
            packet = func
            if func is aten.copy_.default:
                dst, src = args[0], args[1]
                source = self._get(src)
                if source is not None and tuple(dst.shape) == tuple(src.shape):
                    self._write(dst, source)
                else:
                    self._write(dst, None)
                return
            if not args:
                return
            first = args[0]
            if packet is aten.cat.default:
                tensors = list(first)
                dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
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
                self.prov[out] = Provenance(parts[0].name, dim, _merge(i for p in parts for i in p.intervals))
                return
            source = self._get(first)
            if source is None:
                return
            if packet in same:
                if isinstance(out, torch.Tensor) and tuple(out.shape) == tuple(first.shape):
                    self.prov[out] = source
                return
            if packet is aten.slice.Tensor:
                dim = kwargs.get("dim", args[1] if len(args) > 1 else 0) % first.dim()
                start = kwargs.get("start", args[2] if len(args) > 2 else None)
                end = kwargs.get("end", args[3] if len(args) > 3 else None)
                step = kwargs.get("step", args[4] if len(args) > 4 else 1)
                if step != 1:
                    return
                size = first.shape[dim]
                start, end, _ = slice(start, end).indices(size)
                self._slice(out, source, first, dim, start, end)
                return
            if packet in splits:
                dim = kwargs.get("dim", args[2] if len(args) > 2 else 0) % first.dim()
                position = 0
                for piece in out:
                    length = piece.shape[dim]
                    self._slice(piece, source, first, dim, position, position + length)
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
            self.prov[out] = Provenance(source.name, dim, _sub(source.intervals, start, end))

    return ShardLedger


def shard_ledger():
    """A fresh `ShardLedger` (a `TorchDispatchMode`): `register(tensor, name)`, then use it as a context
    manager around code that slices/copies; `provenance(tensor)` tells which rows of `name` it holds."""
    return _ledger_mode()()


# -- checks on meta ---------------------------------------------------------------------------


def expected_intervals(spec, index: int, tp: int) -> tuple:
    """Rows of the full parameter that TP shard `index` of `tp` holds along `spec.dim` (block by block)."""
    out, offset = [], 0
    for block in spec.block_sizes:
        chunk = block // tp
        out.append((offset + index * chunk, chunk))
        offset += block
    return _merge(out)


def shard_index(spec, intervals, tp: int) -> int | None:
    """The TP shard index whose rows are `intervals`, or None when they are no shard."""
    for index in range(tp):
        if expected_intervals(spec, index, tp) == _merge(intervals):
            return index
    return None


def check_tp_shards_meta(model, specs: dict, applied, ledger) -> CheckResult:
    """structure.tp_shards without values: mesh, placements, local shape and the rows each shard holds."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    layout, rank = applied.layout, applied.rank
    params = dict(model.named_parameters())
    problems = []
    untraced = 0
    if layout.has_tp:
        index = layout.coords(rank)["tp"]
        members = layout.tp_group(rank)
        for name, spec in specs.items():
            param = params.get(name)
            if not isinstance(param, DTensor):
                problems.append(f"{name} is not a DTensor")
                continue
            ranks = sorted(dist.get_process_group_ranks(param.device_mesh.get_group()))
            if ranks != members:
                problems.append(f"{name} lives on ranks {ranks}, TP group is {members}")
            want = Replicate() if spec.dim is None else Shard(spec.dim)
            if tuple(param.placements) != (want,):
                problems.append(f"{name} placed {param.placements}, plan says {want}")
                continue
            local = param._local_tensor
            shape = list(param.shape)
            if spec.dim is not None:
                shape[spec.dim] = sum(block // layout.tp for block in spec.block_sizes)
            if list(local.shape) != shape:
                problems.append(f"{name} local shape {list(local.shape)} != TP shard shape {shape}")
                continue
            if spec.dim is None:
                continue
            source = ledger.provenance(local)
            if source is not None and source.name != name:
                problems.append(f"{name} holds rows of {source.name}")
                continue
            if source is not None:
                got = source.along(spec.dim, param.shape[spec.dim])
                if got.dim != spec.dim:
                    problems.append(f"{name} holds a slice along dim {got.dim}, plan shards dim {spec.dim}")
                    continue
                intervals = got.intervals
            else:
                untraced += 1
                if len(spec.block_sizes) > 1:
                    problems.append(f"{name} is packed, and which rows its shard holds could not be traced")
                    continue
                # Scattered by torch (nothing moves on meta): the rows the DTensor's mesh coordinate selects.
                _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
                intervals = ((offset[spec.dim], local.shape[spec.dim]),)
            want_rows = expected_intervals(spec, index, layout.tp)
            if _merge(intervals) != want_rows:
                got_index = shard_index(spec, intervals, layout.tp)
                what = f"TP shard {got_index}" if got_index is not None else f"rows {list(_merge(intervals))}"
                problems.append(f"{name} holds {what} of {layout.tp}, its TP-mesh coordinate is {index}")
    for name, param in params.items():
        if name not in specs and isinstance(param, DTensor):
            problems.append(f"{name} is outside the TP plan but is a DTensor")
    from .checks import _summary

    detail = _summary(problems)
    if not problems and untraced:
        detail = f"{untraced} shard indices from DTensor coordinates (torch scatters them), the rest traced"
    return CheckResult(CheckId.TP_SHARDS, Status.FAIL if problems else Status.PASS, detail)


def neuron_alltoall_problems(ranks: list[int]) -> list[str]:
    """Neuron's all-to-all takes contiguous replica groups of 4, 8, 16 or a multiple of 32 ranks."""
    problems = []
    size = len(ranks)
    if size not in NEURON_ALLTOALL_SIZES and size % 32:
        problems.append(f"all-to-all group of {size} ranks: Neuron takes 4, 8, 16 or a multiple of 32")
    if list(ranks) != list(range(ranks[0], ranks[0] + size)):
        problems.append(f"all-to-all group {list(ranks)} is strided: Neuron takes contiguous replica groups only")
    return problems


def alltoall_groups(applied, counts=None) -> list[list[int]]:
    """The all-to-all groups this rank uses: the library's Ulysses group, and any the forward really used."""
    groups = []
    cp = applied.parallel_config.context_parallel_config if applied.layout.has_cp else None
    if cp is not None and applied.layout.ulysses > 1:
        groups.append(list(dist.get_process_group_ranks(cp._ulysses_mesh.get_group())))
    if counts is not None:
        for (kind, group), _ in counts.ops.items():
            if kind == "all_to_all" and group is not None and list(group) not in groups and len(group) > 1:
                groups.append(list(group))
    return groups


def check_backend_groups(backend: Backend, applied, counts=None) -> CheckResult:
    """backend.groups: the backend's rules on the process groups the library built for this rank."""
    problems = []
    if backend.name == "neuron":
        for group in alltoall_groups(applied, counts):
            problems.extend(neuron_alltoall_problems(group))
    return CheckResult(BACKEND_GROUPS, Status.FAIL if problems else Status.PASS, "; ".join(dict.fromkeys(problems)))


def static_problems(backend: Backend, layout: Layout) -> list[str]:
    """Rules that no process group shows. None left: gloo runs ring since paracheck's own CPU attention op
    returns the log-sum-exp, and every Neuron rule is about groups."""
    return []


# -- one layout -------------------------------------------------------------------------------


def simulate_layout(model_class: type, init_dict: dict, layout: Layout, backend: Backend | str, *,
                    route: str = "auto", control: str | None = None, ranks=None, collectives: bool = False,
                    inputs: dict | None = None) -> LayoutResult:
    """Simulate every rank (or `ranks`) of `layout`; see the module docstring for the checks."""
    return simulate_layout_on(model_class, init_dict, layout, [backend], route=route, control=control, ranks=ranks,
                              collectives=collectives, inputs=inputs)[0]


def simulate_layout_on(model_class: type, init_dict: dict, layout: Layout, backends, *, route: str = "auto",
                       control: str | None = None, ranks=None, collectives: bool = False,
                       inputs: dict | None = None) -> list[LayoutResult]:
    """One simulation of `layout`, judged by each of `backends` (one result each, in order).

    The structure does not depend on the backend (the meshes are CPU meshes either way), so the ranks are
    simulated once and only each backend's rules are applied per backend."""
    from .routes import apply, resolve_route

    backends = [get_backend(b) if isinstance(b, str) else b for b in backends]
    started = time.perf_counter()
    cpu_started = time.process_time()
    if getattr(route, "value", route) not in ROUTES:
        raise SimulationError(f"--route {getattr(route, 'value', route)!r}: a simulation takes one of "
                              f"{', '.join(ROUTES)}")
    route = Route(getattr(route, "value", route))
    shared = LayoutResult(layout, "ok", control=control)

    def finish(status: str, reason: str) -> list[LayoutResult]:
        return [_done(_copy(shared), status, reason, started) for _ in backends]

    try:
        fit = fit_init_dict(model_class, init_dict, layout)
    except Unfittable as exc:
        return finish("unfit", str(exc))
    head_changes = [c for c in fit.changes if "heads" in c.split(" ")[0]]
    if head_changes:
        heads = heads_of(model_class, init_dict)
        return finish("unfit", f"{heads} heads: tp x ulysses = {layout.head_multiple} must divide them "
                               f"(nearest fit: {fit.init_dict[HEADS_KEY]})")
    if fit.changes:  # block counts a plan needs (e.g. `transformer_blocks.1`): the library's own rule
        shared.notes.append(f"fitted: {', '.join(fit.changes)}")
        init_dict = fit.init_dict
    route = resolve_route(route, layout)
    shared.route = route.value
    planted = get_control(control) if control else None
    if planted:
        reason = planted.skip_reason(layout, route)
        if reason:
            return finish("skip", reason)
        if planted.attention_fault:
            return finish("skip", f"{control} bends paracheck's CPU attention op, which a meta forward "
                                  "does not run")
    template = build_meta(model_class, init_dict)
    try:
        specs = library.tp_shard_specs(template, layout.tp) if layout.has_tp else {}
    except ValueError as exc:
        return finish("unfit", f"the library refuses the TP plan: {exc}")
    forward_inputs = _forward_inputs(model_class, inputs, layout, collectives, shared)
    gloo = get_backend("gloo")  # the meshes are CPU meshes: build them with the CPU shims, judge by `backends`
    ledger_cls = _ledger_mode()
    timings = dict.fromkeys(("world", "build", "apply", "checks", "forward"), 0.0)
    per_check: dict[str, dict] = {}
    per_backend: list[dict[str, dict]] = [{} for _ in backends]
    ranks = list(range(layout.world)) if ranks is None else list(ranks)
    with _quiet():
        for rank in ranks:
            t = time.perf_counter()
            with fake_world(rank, layout.world):
                timings["world"] += time.perf_counter() - t
                checks, counts, applied = _simulate_rank(model_class, init_dict, layout, gloo, route, planted,
                                                         template, specs, ledger_cls, forward_inputs, timings, apply)
                judged = [[check_backend_groups(b, applied, counts)] if applied is not None else [] for b in backends]
                t = time.perf_counter()
            timings["world"] += time.perf_counter() - t
            if counts is not None:
                shared.counts[rank] = counts.to_json()
            _tally(per_check, checks, rank)
            for table_, checks_ in zip(per_backend, judged):
                _tally(table_, checks_, rank)
    shared.ranks = len(ranks)
    shared.timings = timings
    cpu = time.process_time() - cpu_started
    results = []
    for backend, own in zip(backends, per_backend):
        result = _copy(shared)
        for check_id, entry in list(per_check.items()) + list(own.items()):
            if entry["fail"]:
                result.failures[check_id] = {"ranks": entry["fail"], "detail": entry["detail"]}
            elif entry["pass"]:
                result.passed.append(check_id)
            else:
                result.skipped[check_id] = entry["skip"]
        if backend.name == "neuron":
            rule = backend.problems(layout)
            derived = "backend.groups" in result.failures
            if bool(rule) != derived:
                result.notes.append(f"backend rule table says {'no' if rule else 'ok'}, the library's groups "
                                    f"say {'no' if derived else 'ok'}")
        static = static_problems(backend, layout)
        reasons = [f"{c} fails on ranks {compress(f['ranks'])}: {f['detail']}" for c, f in result.failures.items()]
        if planted:
            result.detected = any(c.value in result.failures for c in planted.must_trip + (CheckId.COLLECTIVES,))
        result.cpu_seconds = cpu
        results.append(_done(result, "no" if static or result.failures else "ok", "; ".join(static + reasons),
                             started))
    return results


def _tally(table: dict, checks, rank: int) -> None:
    for check in checks:
        entry = table.setdefault(getattr(check.id, "value", check.id), {"fail": [], "pass": 0, "skip": "", "detail": ""})
        if check.status == "fail":
            if not entry["fail"]:
                entry["detail"] = f"rank {rank}: {check.detail}"
            entry["fail"].append(rank)
        elif check.status == "skip":
            entry["skip"] = check.detail
        else:
            entry["pass"] += 1


def _copy(result: LayoutResult) -> LayoutResult:
    import copy

    return copy.deepcopy(result)


def _forward_inputs(model_class, inputs, layout: Layout, collectives: bool, result: LayoutResult):
    if not collectives:
        result.skipped["structure.collectives"] = "not asked for (--collectives)"
        return None
    if not inputs:
        result.skipped["structure.collectives"] = "the model spec gives no inputs, so no forward can run"
        return None
    problems = cp_split_problems(model_class, inputs, layout)
    if problems:
        result.skipped["structure.collectives"] = "; ".join(problems)
        return None
    return meta_inputs(inputs)


def _simulate_rank(model_class, init_dict, layout, gloo, route, control, template, specs, ledger_cls,
                   forward_inputs, timings, apply):
    """One rank, inside its fake world: (structure checks, collective counts or None, Applied or None)."""
    rank = dist.get_rank()
    t = time.perf_counter()
    model = build_meta(model_class, init_dict)
    if forward_inputs is not None and layout.ring > 1:
        model.set_attention_backend(RING_META_BACKEND)
    timings["build"] += time.perf_counter() - t
    t = time.perf_counter()
    ledger = ledger_cls()
    for name, param in model.named_parameters():
        if name in specs:
            ledger.register(param, name)
    for name, param in template.named_parameters():
        if name in specs:
            ledger.register(param, name)
    try:
        with ledger if specs else contextlib.nullcontext():  # without TP there are no shards to follow
            model, applied = apply(route, model, layout, gloo, control, template, None)
    except Exception as exc:
        timings["apply"] += time.perf_counter() - t
        return [CheckResult(APPLY, Status.FAIL, f"{type(exc).__name__}: {exc}")], None, None
    timings["apply"] += time.perf_counter() - t
    t = time.perf_counter()
    ctx = CheckContext(model, template, applied, ref_out=None, weights=None, atol=0.0, rtol=0.0)
    checks = [
        check_mesh(ctx),
        check_cp_hooks(ctx),
        check_processor_config(ctx),
        check_tp_shards_meta(model, specs, applied, ledger),
    ]
    timings["checks"] += time.perf_counter() - t
    counts = None
    if forward_inputs is not None:
        from .collectives import count_collectives, verdict

        t = time.perf_counter()
        try:
            with torch.no_grad(), count_collectives(model, rank) as counts:
                out = model(**dict(forward_inputs), return_dict=False)
                for tensor in out if isinstance(out, (tuple, list)) else (out,):
                    if hasattr(tensor, "wait") and callable(tensor.wait):
                        tensor.wait()  # an AsyncCollectiveTensor from the output gather: settle it
            checks.append(verdict(counts, layout, rank))
        except Exception as exc:
            checks.append(CheckResult(CheckId.COLLECTIVES, Status.FAIL,
                                      f"forward on meta raised {type(exc).__name__}: {exc}"))
            counts = None
        timings["forward"] += time.perf_counter() - t
    return checks, counts, applied


def _done(result: LayoutResult, status: str, reason: str, started: float) -> LayoutResult:
    result.status = status
    result.reason = reason
    result.seconds = time.perf_counter() - started
    return result


# -- many layouts -----------------------------------------------------------------------------


def simulate(model_class: type, init_dict: dict, backend: Backend | str, world: int, layouts=None, *,
             order: str = "cp-fastest", route: str = "auto", control: str | None = None,
             collectives: bool = False, inputs: dict | None = None, progress=None) -> list[LayoutResult]:
    """Every layout of `world` (or `layouts`: Layout objects or names), each simulated on every rank."""
    name = backend if isinstance(backend, str) else backend.name
    return simulate_on(model_class, init_dict, [backend], world, layouts, order=order, route=route, control=control,
                       collectives=collectives, inputs=inputs, progress=progress)[name]


def simulate_on(model_class: type, init_dict: dict, backends, world: int, layouts=None, *,
                order: str = "cp-fastest", route: str = "auto", control: str | None = None,
                collectives: bool = False, inputs: dict | None = None, progress=None) -> dict[str, list[LayoutResult]]:
    """`simulate` judged by several backends from one simulation: backend name -> results."""
    backends = [get_backend(b) if isinstance(b, str) else b for b in backends]
    if not isinstance(world, int) or not 2 <= world <= MAX_WORLD:
        raise SimulationError(f"--world {world}: a simulation takes 2 to {MAX_WORLD} ranks")
    if layouts is None:
        chosen = layouts_for(world, order)
    else:
        chosen = [Layout.parse(l, order) if isinstance(l, str) else l for l in layouts]
        for layout in chosen:
            if layout.world != world:
                raise SimulationError(f"--layout {layout}: its world size is {layout.world}, but --world is {world}")
    out: dict[str, list[LayoutResult]] = {b.name: [] for b in backends}
    for layout in chosen:
        results = simulate_layout_on(model_class, init_dict, layout, backends, route=route, control=control,
                                     collectives=collectives, inputs=inputs)
        for backend, result in zip(backends, results):
            out[backend.name].append(result)
        if progress:
            progress(results[0])
    return out


# -- reporting --------------------------------------------------------------------------------


def compress(ranks) -> str:
    """[0, 1, 2, 3, 8, 9] -> '0-3,8-9'."""
    ranks = sorted(ranks)
    if not ranks:
        return ""
    parts, start, prev = [], ranks[0], ranks[0]
    for rank in ranks[1:] + [None]:
        if rank is not None and rank == prev + 1:
            prev = rank
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if rank is not None:
            start = prev = rank
    return ",".join(parts)


def short_reason(result: LayoutResult) -> str:
    """The table's reason: failing checks by rank (their details follow the table), or why not simulated."""
    if not result.failures:
        return result.reason
    parts = [f"{_SHORT.get(c, c)} fails on ranks {compress(f['ranks'])}" for c, f in result.failures.items()]
    return "; ".join(parts)


def table(results: list[LayoutResult]) -> str:
    header = ["layout", "verdict"] + [_SHORT[c] for c in SIM_CHECKS] + ["ranks", "ms/rank", "cpu ms", "reason"]
    rows = []
    for r in results:
        cells = [r.layout.name, r.status]
        for check in SIM_CHECKS:
            if check in r.failures:
                cells.append("FAIL")
            elif check in r.passed:
                cells.append("ok")
            else:
                cells.append("-")
        cells += [str(r.ranks or "-"), f"{1000 * r.per_rank:.0f}" if r.ranks else "-",
                  f"{1000 * r.cpu_per_rank:.0f}" if r.ranks else "-", short_reason(r)]
        if r.control:
            cells[1] = f"{r.status} ({'detected' if r.detected else 'MISSED' if r.detected is False else r.status})"
        rows.append(cells)
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    widths[-1] = 0
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip(),
             "  ".join("-" * max(w, len(h)) for h, w in zip(header, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)
