"""Simulated layouts: every rank of a layout built, parallelized and judged on meta in one process, then
tallied into one `LayoutResult` per backend.

Each rank joins torch's fake process group and builds the model on meta (`fakeworld`), parallelizes it
through the kit's own routes (`routes.apply`: the library's `enable_parallelism`, or the shared mesh plus
`apply_context_parallel` / `apply_tensor_parallel`), and is judged on what the library really built:

- structure.mesh, structure.cp_hooks, structure.processor_config: the kit's own checks, unchanged.
- structure.tp_shards: placements, mesh, local shape and the shard *index* (`shardledger`).
- backend.groups: the backend's rules on the process groups the library built (Neuron: every all-to-all
  group contiguous and of size 4, 8, 16 or a multiple of 32).
- structure.collectives (opt-in): one forward on meta tensors, its collectives counted per group
  (`collectives`). Ring attention runs diffusers' `_native_flash` backend there, whose meta kernel returns
  the log-sum-exp that native attention lacks.

What is reused across ranks: the imports, a pristine meta "template" model (the reference the controls
plant from), the TP shard specs, the meta inputs. What is not: the process group, the mesh and the model,
which every rank builds afresh (all three are cheap; see `LayoutResult.timings`).
"""

from __future__ import annotations

import contextlib
import enum
import copy
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from paracheck.adapters.diffusers import library
from paracheck.domain.backends import Backend, get_backend
from paracheck.adapters.diffusers.checks import CheckContext, check_cp_hooks, check_mesh, check_processor_config
from paracheck.domain.registry import get_control
from paracheck.domain.control import Control
from paracheck.adapters.diffusers.simulate.fakeworld import build_meta, fake_world, meta_inputs, quiet
from paracheck.adapters.diffusers.fitting import HEADS_KEY, Unfittable, cp_split_problems, fit_init_dict, init_value
from paracheck.adapters.diffusers.layout import DiffusersLayout, backend_problems, heads_unfit, layouts_for
from paracheck.domain.layout import Layout
from paracheck.domain.records import CheckId, CheckResult, MergedCheck, Route, Status
from paracheck.results.verdict import merge_check
from paracheck.adapters.diffusers.simulate.shardledger import check_tp_shards_meta, shard_ledger

MAX_WORLD = 128
ROUTES = ("auto", "native", "composed")
#: Not a check: the route itself raised while parallelizing on meta (the JSON's key for `LayoutResult.raised`).
APPLY = "simulate.apply"
#: The checks a simulated rank reports, in table order.
SIM_CHECKS = (CheckId.MESH, CheckId.CP_HOOKS, CheckId.PROCESSOR_CONFIG, CheckId.TP_SHARDS, CheckId.BACKEND_GROUPS,
              CheckId.COLLECTIVES)
#: The attention backend a ring layout's forward runs on meta (native attention returns no LSE).
RING_META_BACKEND = "_native_flash"
_PHASES = ("world", "build", "apply", "checks", "forward")


class SimulationError(ValueError):
    """Bad input to a simulation (the CLI turns it into exit 2)."""


class LayoutStatus(str, enum.Enum):
    """A simulated layout's outcome for one backend."""
    OK = "ok"
    #: The backend cannot run it, or a check failed.
    NO = "no"
    #: Not simulated: the model does not fit the layout.
    UNFIT = "unfit"
    #: Not simulated: the control does not apply.
    SKIP = "skip"


class _NotSimulated(Exception):
    """The layout is not simulated (`status` says why: unfit or skip)."""

    def __init__(self, status: LayoutStatus, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


@dataclass
class LayoutResult:
    layout: Layout
    status: LayoutStatus
    reason: str = ""
    route: str = ""
    #: Every check that ran, merged over the simulated ranks as a run merges its ranks (`verdict.merge_check`).
    checks: dict[CheckId, MergedCheck] = field(default_factory=dict)
    #: Checks that did not run on any rank, and why (`--collectives` not asked, no inputs).
    not_run: dict[CheckId, str] = field(default_factory=dict)
    #: The route raised while parallelizing on meta: {"ranks": [...], "detail": first rank's error}.
    raised: dict | None = None
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
    def failures(self) -> dict[str, dict]:
        """check id (and `simulate.apply`) -> {"ranks": the failing ranks, "detail": "rank R: the first one's"}."""
        out = {c.value: {"ranks": m.failed_ranks, "detail": f"rank {m.failed_ranks[0]}: {m.detail}"
                         if m.detail_rank is None else f"rank {m.detail_rank}: {m.detail}"}
               for c, m in self.checks.items() if m.status is Status.FAIL}
        if self.raised:
            out[APPLY] = self.raised
        return out

    @property
    def passed(self) -> list[str]:
        """Check ids that ran on some rank and passed on every rank that ran them."""
        return [c.value for c, m in self.checks.items() if m.status is Status.PASS]

    @property
    def skipped(self) -> dict[str, str]:
        out = {c.value: reason for c, reason in self.not_run.items()}
        out.update({c.value: m.detail for c, m in self.checks.items() if m.status is Status.SKIP})
        return out

    @property
    def structure_failed(self) -> bool:
        return self.raised is not None or any(c.structural for c in self.checks if c.value in self.failures)

    def to_json(self) -> dict:
        return {
            "layout": self.layout.name, "order": self.layout.order, "status": self.status.value, "reason": self.reason,
            "route": self.route, "failures": self.failures, "passed": self.passed, "skipped": self.skipped,
            "notes": self.notes, "ranks": self.ranks, "seconds": round(self.seconds, 3),
            "per_rank": round(self.per_rank, 4), "cpu_seconds": round(self.cpu_seconds, 3),
            "cpu_per_rank": round(self.cpu_per_rank, 4), "timings": {k: round(v, 3) for k, v in self.timings.items()},
            "control": self.control, "detected": self.detected,
        }


# -- the backend's group rules ----------------------------------------------------------------------


def alltoall_groups(applied, counts=None) -> list[list[int]]:
    """The all-to-all groups this rank uses: the library's Ulysses group, and any the forward really used."""
    groups = []
    if applied.layout.has_cp and applied.layout.ulysses > 1:
        mesh = library.ulysses_mesh(applied.parallel_config.context_parallel_config)
        groups.append(list(dist.get_process_group_ranks(mesh.get_group())))
    if counts is not None:
        for (kind, group), _ in counts.ops.items():
            if kind == "all_to_all" and group is not None and list(group) not in groups and len(group) > 1:
                groups.append(list(group))
    return groups


def check_backend_groups(backend: Backend, applied, counts=None) -> CheckResult:
    """backend.groups: the backend's rules on the process groups the library built for this rank."""
    problems = [p for group in alltoall_groups(applied, counts) for p in backend.group_problems(group)]
    return CheckResult(CheckId.BACKEND_GROUPS, Status.FAIL if problems else Status.PASS,
                       "; ".join(dict.fromkeys(problems)))


# -- one rank ---------------------------------------------------------------------------------------


@dataclass
class _Setup:
    """What every rank of one layout shares: the fitted model, the route, the template, the specs."""
    model_class: type
    init_dict: dict
    layout: Layout
    route: Route
    control: Control | None
    template: object
    specs: dict
    forward_inputs: dict | None
    timings: dict = field(default_factory=lambda: dict.fromkeys(_PHASES, 0.0))


@contextlib.contextmanager
def _timed(timings: dict, phase: str):
    started = time.perf_counter()
    try:
        yield
    finally:
        timings[phase] += time.perf_counter() - started


def _simulate_rank(s: _Setup):
    """This rank, inside its fake world: (its checks, its collective counts or None, its Applied or None)."""
    from paracheck.adapters.diffusers.routes import apply

    with _timed(s.timings, "build"):
        model = build_meta(s.model_class, s.init_dict)
    try:
        with _timed(s.timings, "apply"):
            ledger = _ledger(s, model)
            with ledger if s.specs else contextlib.nullcontext():  # without TP there are no shards to follow
                # The meshes are CPU meshes whatever the backend judged: build them with gloo's shims.
                model, applied = apply(s.route, model, s.layout, get_backend("gloo"), s.control, s.template, None)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", None, None
    with _timed(s.timings, "checks"):
        ctx = CheckContext(model, s.template, applied, ref_out=None, weights=None, atol=0.0, rtol=0.0)
        checks = [check_mesh(ctx), check_cp_hooks(ctx), check_processor_config(ctx),
                  check_tp_shards_meta(model, s.specs, applied, ledger)]
    counts = None
    if s.forward_inputs is not None:
        with _timed(s.timings, "forward"):
            check, counts = _forward_collectives(model, s.forward_inputs, s.layout)
        checks.append(check)
    return checks, counts, applied


def _ledger(s: _Setup, model):
    """A shard ledger that knows the planned parameters of `model` and of the template controls plant from."""
    ledger = shard_ledger()
    for source in (model, s.template):
        for name, param in source.named_parameters():
            if name in s.specs:
                ledger.register(param, name)
    return ledger


def _forward_collectives(model, inputs: dict, layout: Layout):
    """structure.collectives from one forward on meta: (its CheckResult, the Counts or None if it raised)."""
    from paracheck.adapters.diffusers.collectives import check_counts, count_collectives

    rank = dist.get_rank()
    # Scoped: `model.set_attention_backend` would leave the process's active backend changed for good.
    backend = library.named_attention_backend(RING_META_BACKEND) if layout.ring > 1 else contextlib.nullcontext()
    try:
        # Findings supplies the `warning_once` diffusers' CP hooks call on a plain logger (Wan's 1-D timestep).
        with backend, library.Findings(), torch.no_grad(), count_collectives(rank, library.observed_attention) as counts:
            out = model(**dict(inputs), return_dict=False)
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                if hasattr(tensor, "wait") and callable(tensor.wait):
                    tensor.wait()  # an AsyncCollectiveTensor from the output gather: settle it
    except Exception as exc:
        return CheckResult(CheckId.COLLECTIVES, Status.FAIL, f"forward on meta raised {type(exc).__name__}: {exc}"), None
    return check_counts(counts, layout), counts


# -- one layout -------------------------------------------------------------------------------------


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
    backends = [get_backend(b) if isinstance(b, str) else b for b in backends]
    started, cpu_started = time.perf_counter(), time.process_time()
    route = _route(route)
    shared = LayoutResult(layout, LayoutStatus.OK, control=control)
    try:
        setup = _setup(model_class, init_dict, layout, route, control, collectives, inputs, shared)
    except _NotSimulated as exc:
        return [_done(copy.deepcopy(shared), exc.status, exc.reason, started) for _ in backends]
    ranks = list(range(layout.world)) if ranks is None else list(ranks)
    per_check, per_backend = _run_ranks(setup, ranks, backends, shared)
    shared.ranks, shared.timings = len(ranks), setup.timings
    cpu = time.process_time() - cpu_started
    return [_judge(shared, backend, per_check, own, setup.control, cpu, started)
            for backend, own in zip(backends, per_backend)]


def _route(route) -> Route:
    name = getattr(route, "value", route)
    if name not in ROUTES:
        raise SimulationError(f"--route {name!r}: a simulation takes one of {', '.join(ROUTES)}")
    return Route(name)


def _setup(model_class, init_dict, layout, route, control, collectives, inputs, shared):
    """The shared part of every rank; raises `_NotSimulated` when the layout is not simulated."""
    from paracheck.adapters.diffusers.routes import resolve_route

    try:
        fit = fit_init_dict(model_class, init_dict, layout)
    except Unfittable as exc:
        raise _NotSimulated(LayoutStatus.UNFIT, str(exc)) from exc
    if any("heads" in c.split(" ")[0] for c in fit.changes):
        raise _NotSimulated(LayoutStatus.UNFIT, heads_unfit(init_value(model_class, init_dict, HEADS_KEY), layout,
                                                            fit.init_dict[HEADS_KEY]))
    if fit.changes:  # block counts a plan needs (e.g. `transformer_blocks.1`): the library's own rule
        shared.notes.append(f"fitted: {', '.join(fit.changes)}")
        init_dict = fit.init_dict
    route = resolve_route(route, layout, "meta")  # a simulation's ranks hold meta tensors
    shared.route = route.value
    planted = get_control(control) if control else None
    reason = _control_skip(planted, layout, route)
    if reason:
        raise _NotSimulated(LayoutStatus.SKIP, reason)
    template = build_meta(model_class, init_dict)
    try:
        specs = library.tp_shard_specs(template, layout.tp) if layout.has_tp else {}
    except ValueError as exc:
        raise _NotSimulated(LayoutStatus.UNFIT, f"the library refuses the TP plan: {exc}") from exc
    return _Setup(model_class, init_dict, layout, route, planted, template, specs,
                  _forward_inputs(model_class, inputs, layout, collectives, shared))


def _control_skip(planted: Control | None, layout: Layout, route: Route) -> str | None:
    if planted is None:
        return None
    reason = planted.skip_reason(layout, route)
    if reason is None and planted.attention_fault:
        reason = (f"{planted.name} bends an attention backend's collectives, which a meta forward (no values, "
                  "no real groups) cannot show")
    return reason


def _forward_inputs(model_class, inputs, layout: Layout, collectives: bool, result: LayoutResult):
    if not collectives:
        result.not_run[CheckId.COLLECTIVES] = "not asked for (--collectives)"
        return None
    if not inputs:
        result.not_run[CheckId.COLLECTIVES] = "the model spec gives no inputs, so no forward can run"
        return None
    problems = cp_split_problems(model_class, inputs, layout)
    if problems:
        result.not_run[CheckId.COLLECTIVES] = "; ".join(problems)
        return None
    return meta_inputs(inputs)


def _run_ranks(setup: _Setup, ranks: list[int], backends, shared: LayoutResult):
    """Every rank in its own fake world: (rank, result) per shared check, and per check of each backend."""
    per_check: dict[CheckId, list] = {}
    per_backend: list[dict[CheckId, list]] = [{} for _ in backends]
    with quiet():
        for rank in ranks:
            checks, counts, judged = _in_world(setup, rank, backends)
            if counts is not None:
                shared.counts[rank] = counts.to_json()
            if isinstance(checks, str):  # the route raised on this rank
                shared.raised = shared.raised or {"ranks": [], "detail": f"rank {rank}: {checks}"}
                shared.raised["ranks"].append(rank)
                continue
            _collect(per_check, checks, rank)
            for table, own in zip(per_backend, judged):
                _collect(table, own, rank)
    return per_check, per_backend


def _in_world(setup: _Setup, rank: int, backends):
    """One rank in its fake world: its checks, its counts, each backend's group check; `world` times only
    joining and leaving the fake group."""
    t = time.perf_counter()
    with fake_world(rank, setup.layout.world):
        setup.timings["world"] += time.perf_counter() - t
        checks, counts, applied = _simulate_rank(setup)
        judged = [[check_backend_groups(b, applied, counts)] if applied is not None else [] for b in backends]
        t = time.perf_counter()
    setup.timings["world"] += time.perf_counter() - t
    return checks, counts, judged


def _collect(table: dict[CheckId, list], checks: list[CheckResult], rank: int) -> None:
    for check in checks:
        table.setdefault(check.id, []).append((rank, check))


def _judge(shared: LayoutResult, backend: Backend, per_check: dict, own: dict, planted, cpu: float,
           started: float) -> LayoutResult:
    """One backend's result from the tallies: failures, passes, skips, and the rule table cross-check."""
    from paracheck.launch.attribution import ranks_named

    result = copy.deepcopy(shared)
    for check_id in SIM_CHECKS:
        per_rank = per_check.get(check_id) or own.get(check_id)
        if per_rank:
            result.checks[check_id] = merge_check(check_id, per_rank)
    if backend.name == "neuron":
        groups = result.checks.get(CheckId.BACKEND_GROUPS)
        rule, derived = backend_problems(backend, result.layout), groups is not None and groups.status is Status.FAIL
        if bool(rule) != derived:
            result.notes.append(f"backend rule table says {'no' if rule else 'ok'}, the library's groups "
                                f"say {'no' if derived else 'ok'}")
    if planted:
        result.detected = any(c.value in result.failures for c in planted.must_trip + (CheckId.COLLECTIVES,))
    result.cpu_seconds = cpu
    reasons = [f"{c} fails on {ranks_named(f['ranks'])}: {f['detail']}" for c, f in result.failures.items()]
    return _done(result, LayoutStatus.NO if result.failures else LayoutStatus.OK, "; ".join(reasons), started)


def _done(result: LayoutResult, status: LayoutStatus, reason: str, started: float) -> LayoutResult:
    result.status = status
    result.reason = reason
    result.seconds = time.perf_counter() - started
    return result


# -- many layouts -----------------------------------------------------------------------------------


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
        chosen = [DiffusersLayout.parse(l, order) if isinstance(l, str) else l for l in layouts]
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
