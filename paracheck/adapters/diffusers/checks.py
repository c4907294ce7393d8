"""Checks: structure and numbers on every rank, registered by id, each taking one `CheckContext`.

Each check returns one `CheckResult` for this rank; the launcher merges ranks and names the failing
ones. The stable ids (and the report's short names) are `records.CheckId`. The structure checks of
`STRUCTURE` run before the forward (so a planted bug that breaks the forward still gets them); the
collectives, counted during the forward, are judged after it, then the forward, then grads.
"""

from __future__ import annotations

import copy
import functools
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from paracheck.adapters.diffusers import library
from paracheck.adapters.diffusers.splits import plan_modules
from paracheck.checks import grads
from paracheck.checks.buckets import gather_each, reduce_each
from paracheck.checks.compare import compare, problems_text
from paracheck.checks.shards import assemble, group_ranks, local_slice
from paracheck.domain.localization import GradRow
from paracheck.domain.records import CheckId, CheckResult, Raised, Status
from paracheck.world.recent import Recent

@dataclass
class CheckContext:
    """Everything a check may read about one case on this rank; later phases fill in the rest."""
    model: torch.nn.Module
    reference: torch.nn.Module
    applied: object  # routes.Applied
    ref_out: torch.Tensor
    weights: torch.Tensor
    atol: float
    rtol: float
    grads_requested: bool = True
    #: For a reduced-precision run: the fp32 single-device output and gradients (see `compare`).
    ref_out32: torch.Tensor | None = None
    ref_grads32: dict = field(default_factory=dict)
    out: torch.Tensor | None = None
    forward_error: Raised | None = None
    #: The collectives the parallel forward issued on this rank (`collectives.Counts`), when counted.
    collectives: object | None = None
    backward_error: Raised | None = None
    #: The inference pass: the same forward under `torch.no_grad()`, as pipelines call a model.
    inference_out: torch.Tensor | None = None
    inference_error: Raised | None = None
    inference_collectives: object | None = None
    #: The reference's gradients in float64, once `_fp64_grads` computed them.
    grads64: dict | None = None
    #: The case's inputs on this rank's device (the fp64 gradients of `rounding_rule` rerun the reference on them).
    inputs: dict = field(default_factory=dict)

    @property
    def layout(self):
        return self.applied.layout

    @property
    def rank(self) -> int:
        return self.applied.rank


CHECKS: dict[CheckId, Callable[[CheckContext], CheckResult]] = {}
STRUCTURE = (CheckId.MESH, CheckId.CP_HOOKS, CheckId.PROCESSOR_CONFIG, CheckId.TP_SHARDS)


def check(check_id: CheckId):
    def register(fn):
        CHECKS[check_id] = fn
        return fn
    return register


def run_checks(ids, ctx: CheckContext) -> list[CheckResult]:
    return [CHECKS[i](ctx) for i in ids]


def _result(check_id: CheckId, problems: list[str]) -> CheckResult:
    return CheckResult(check_id, Status.FAIL if problems else Status.PASS, problems_text(problems))


# -- structure ---------------------------------------------------------------------------------


@check(CheckId.MESH)
def check_mesh(ctx: CheckContext) -> CheckResult:
    applied, layout, rank = ctx.applied, ctx.layout, ctx.rank
    problems = []
    expected = {}
    if layout.has_cp:
        expected["cp"] = (("ring", "ulysses"), layout.cp_group(rank))
    if layout.has_tp:
        expected["tp"] = (("tp",), layout.tp_group(rank))
    shared = library.shared_mesh(applied.parallel_config)
    if applied.route.value == "composed" and shared is not None:
        got = (tuple(shared.mesh_dim_names or ()), tuple(shared.shape))
        if got != (layout.mesh_dims, layout.mesh_shape):
            problems.append(f"shared mesh {got} != layout's {(layout.mesh_dims, layout.mesh_shape)}")
    for part, (dims, members) in expected.items():
        problems.extend(_mesh_part_problems(applied, part, dims, members))
    return _result(CheckId.MESH, problems)


def _mesh_part_problems(applied, part: str, dims: tuple[str, ...], members: list[int]) -> list[str]:
    layout, rank = applied.layout, applied.rank
    mesh = applied.meshes.get(part)
    if mesh is None:
        return [f"no {part} mesh"]
    problems = []
    names = tuple(mesh.mesh_dim_names or ())
    coords = layout.coords(rank)
    for dim in dims:
        if dim not in names:
            problems.append(f"{part} mesh lacks dim {dim!r}")
            continue
        size = mesh.size(names.index(dim))
        if size != getattr(layout, dim):
            problems.append(f"{part} mesh dim {dim} has size {size}, layout says {getattr(layout, dim)}")
        if mesh.get_local_rank(dim) != coords[dim]:
            problems.append(f"rank {rank} sits at {dim}={mesh.get_local_rank(dim)}, layout says {coords[dim]}")
    if all(d in names for d in dims):
        got = _library_group(applied, part)
        if got != members:
            problems.append(f"{part} group {got} != layout's {members}")
    return problems


def _library_group(applied, part: str) -> list[int]:
    """The ranks the library will actually communicate with for `part`."""
    if part == "cp":
        return group_ranks(library.cp_flattened_mesh(applied.parallel_config.context_parallel_config))
    return group_ranks(applied.meshes["tp"], "tp")


@check(CheckId.CP_HOOKS)
def check_cp_hooks(ctx: CheckContext) -> CheckResult:
    model, problems = ctx.model, []
    if ctx.layout.has_cp:
        for module_id, entry in model._cp_plan.items():
            hook = library.cp_hook_name(module_id, is_input=isinstance(entry, dict))
            for module in plan_modules(model, module_id):
                if hook not in library.hook_names(module):
                    problems.append(f"{module_id or '<root>'} lacks {hook}")
    else:
        for name, module in model.named_modules():
            stray = [h for h in library.hook_names(module) if h.startswith((library.CP_INPUT, library.CP_OUTPUT))]
            problems.extend(f"{name or '<root>'} carries {h} without CP" for h in stray)
    return _result(CheckId.CP_HOOKS, problems)


@check(CheckId.PROCESSOR_CONFIG)
def check_processor_config(ctx: CheckContext) -> CheckResult:
    layout = ctx.layout
    processors = library.attention_processors(ctx.model)
    problems = []
    if not layout.has_cp:
        problems.extend(f"{name}: TP alone, yet processor holds a parallel config"
                        for name, p in processors if library.processor_config(p) is not None)
        return _result(CheckId.PROCESSOR_CONFIG, problems)
    if not processors:
        problems.append("no attention processor takes a parallel config, so attention cannot run Ulysses/ring")
    for name, processor in processors:
        config = library.processor_config(processor)
        cp = getattr(config, "context_parallel_config", None)
        if config is None or cp is None:
            problems.append(f"{name}: processor holds no CP config")
        elif config is not ctx.applied.parallel_config:
            problems.append(f"{name}: processor holds another config than the run's")
        elif (cp.ring_degree, cp.ulysses_degree) != (layout.ring, layout.ulysses):
            problems.append(f"{name}: CP degrees {(cp.ring_degree, cp.ulysses_degree)} != layout's")
    return _result(CheckId.PROCESSOR_CONFIG, problems)


@check(CheckId.TP_SHARDS)
def check_tp_shards(ctx: CheckContext) -> CheckResult:
    from torch.distributed.tensor import DTensor

    layout = ctx.layout
    params = dict(ctx.model.named_parameters())
    ref_params = dict(ctx.reference.named_parameters())
    planned = library.tp_shard_specs(ctx.reference, layout.tp) if layout.has_tp else {}
    problems = []
    for name, spec in planned.items():
        problems.extend(_shard_problems(name, params.get(name), ref_params[name], spec, ctx))
    for name, param in params.items():
        if name in planned:
            continue
        if isinstance(param, DTensor):
            problems.append(f"{name} is outside the TP plan but is a DTensor")
        elif not torch.equal(param.detach(), ref_params[name].detach().to(param.device)):
            problems.append(f"{name} is outside the TP plan but differs from the reference")
    result = _result(CheckId.TP_SHARDS, problems)
    if ctx.applied.stood_in:  # the shards came off a library path the kit stood a device in for: say so
        result.data["stood_in"] = ctx.applied.stood_in
    return result


def _shard_problems(name: str, param, ref_param, spec, ctx: CheckContext) -> list[str]:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    layout, rank = ctx.layout, ctx.rank
    if not isinstance(param, DTensor):
        return [f"{name} is not a DTensor"]
    members = layout.tp_group(rank)
    problems = []
    if group_ranks(param.device_mesh) != members:
        problems.append(f"{name} lives on ranks {group_ranks(param.device_mesh)}, TP group is {members}")
    want = Replicate() if spec.dim is None else Shard(spec.dim)
    if tuple(param.placements) != (want,):
        return problems + [f"{name} placed {param.placements}, plan says {want}"]
    index = layout.coords(rank)["tp"]
    expected = local_slice(ref_param.detach(), spec, index, layout.tp)
    local = param.to_local()
    if local.shape != expected.shape or not torch.equal(local.cpu(), expected.cpu()):
        problems.append(f"{name} local tensor is not TP shard {index} of {layout.tp}")
    return problems


@check(CheckId.COLLECTIVES)
def check_collectives(ctx: CheckContext) -> CheckResult:
    """Both passes, training and inference, issue the collectives the layout needs; the training pass's
    counts are the check's data, the inference pass's go under `data["no_grad"]`."""
    from paracheck.adapters.diffusers import collectives

    passes = [("", ctx.collectives, ctx.forward_error), ("inference pass: ", ctx.inference_collectives,
                                                          ctx.inference_error)]
    results = []
    for label, counts, raised in passes:
        if raised:
            return CheckResult(CheckId.COLLECTIVES, Status.SKIP, f"{label}the forward raised, so its collectives "
                               "are incomplete")
        if counts is None:
            return CheckResult(CheckId.COLLECTIVES, Status.SKIP, f"{label}the forward's collectives were not counted")
        results.append((label, collectives.check_counts(_as_this_rank(counts), ctx.layout)))
    (_, training), (label, inference) = results
    if inference.status == Status.FAIL and training.status == Status.PASS:
        training.status, training.detail = Status.FAIL, label + inference.detail
    elif inference.status == Status.FAIL and inference.detail != training.detail:
        training.detail += f"; {label}{inference.detail}"
    training.data["no_grad"] = inference.data
    return training


def _as_this_rank(counts):
    """The counts as this rank holds them: in a local world they were counted once, as rank 0, for every rank."""
    rank = dist.get_rank()
    if counts.rank == rank:
        return counts
    from paracheck.world.localworld import same_shape_group

    world = dist.get_world_size()
    return counts.seen_by(rank, lambda group: same_shape_group(group, rank, world))


# -- numbers -----------------------------------------------------------------------------------


@check(CheckId.FORWARD)
def check_forward(ctx: CheckContext) -> CheckResult:
    if ctx.forward_error:
        return CheckResult(CheckId.FORWARD, Status.FAIL, f"forward raised {ctx.forward_error}",
                           failure=ctx.forward_error.failure)
    return compare(CheckId.FORWARD, ctx.out, ctx.ref_out, ctx.atol, ctx.rtol, expected32=ctx.ref_out32)


@check(CheckId.INFERENCE)
def check_inference(ctx: CheckContext) -> CheckResult:
    """The forward under `torch.no_grad()` against the same reference, by the same rule as the forward:
    backends and TP layers branch on whether a gradient is recorded."""
    if ctx.inference_error:
        return CheckResult(CheckId.INFERENCE, Status.FAIL, f"forward under no_grad raised {ctx.inference_error}",
                           failure=ctx.inference_error.failure)
    return compare(CheckId.INFERENCE, ctx.inference_out, ctx.ref_out, ctx.atol, ctx.rtol, what="no-grad output",
                   expected32=ctx.ref_out32)


def grads_skip_reason(ctx: CheckContext) -> str | None:
    """Why the backward is not run for this case; None when it is."""
    if not ctx.grads_requested:
        return "--no-grads"
    if ctx.forward_error:
        return "forward raised"
    if tuple(ctx.out.shape) != tuple(ctx.ref_out.shape):
        return "the output shape differs, so the loss cannot match"
    return None


@check(CheckId.GRADS)
def check_grads(ctx: CheckContext) -> CheckResult:
    skip = grads_skip_reason(ctx)
    if skip:
        return CheckResult(CheckId.GRADS, Status.SKIP, skip)
    if ctx.backward_error:
        return CheckResult(CheckId.GRADS, Status.FAIL, f"backward raised {ctx.backward_error}",
                           failure=ctx.backward_error.failure)
    return _compare_grads(ctx)


def _compare_grads(ctx: CheckContext) -> CheckResult:
    """Reassemble every gradient, then judge each by the shared rule (`checks.grads`) at diffusers' strictness
    (`_rule`); reports the parameters beyond tolerance and, separately, the one with the largest max_abs (which can
    be within tolerance: the bound is elementwise, atol + rtol |ref|). A failing check carries every parameter's
    error in `data["localization"]["grads"]`."""
    layout, applied = ctx.layout, ctx.applied
    specs = library.tp_shard_specs(ctx.reference, layout.tp) if layout.has_tp else {}
    groups = _Groups(cp_process_group(applied), applied.meshes["tp"].get_group() if layout.has_tp else None)
    ref_params = dict(ctx.reference.named_parameters())
    tp_partial = []
    params = sorted(ctx.model.named_parameters())
    # Every rank has the same parameters with and without a gradient (the model's structure decides),
    # so every rank issues the same collectives here.
    wholes = _whole_grads({n: p.grad for n, p in params if p.grad is not None}, specs, groups, tp_partial)
    judged = grads.judge(((n, wholes.get(n), ref_params[n].grad) for n, _ in params), ctx.atol, ctx.rtol, _rule(ctx))
    worst = CheckResult(CheckId.GRADS, Status.PASS, atol=ctx.atol, rtol=ctx.rtol, max_abs=0.0, max_rel=0.0)
    failures, ratio = [], 0.0
    by_name = dict(params)
    for j in judged:
        result = j.result
        if result is None:
            frozen = "" if by_name[j.name].requires_grad else " (requires_grad=False)"
            failures.append(f"{j.name} has no gradient{frozen}" if j.entry.why == "no gradient"
                            else f"{j.name} has a gradient the reference lacks")
            continue
        ratio = max(ratio, (result.data or {}).get("ratio", 0.0))
        if j.failed:
            failures.append(f"{j.name} ({_figure(result.max_abs)}, {_over(j.entry)})")
        if result.max_abs is not None and result.max_abs >= (worst.max_abs or 0.0):
            within = "within tolerance" if result.status == Status.PASS else "beyond tolerance"
            worst.max_abs, worst.max_rel = result.max_abs, result.max_rel
            worst.detail = f"largest max_abs: {j.name} ({_figure(result.max_abs)}, {within})"
            worst.data = dict(result.data, param=j.name) if result.data else {}
    if worst.data:
        worst.data["ratio"] = ratio  # the parameter furthest over its own bound, which need not be the worst
    notes = [worst.detail] if worst.detail else []
    if tp_partial:
        notes.append(f"{len(tp_partial)} params outside the TP plan have TP-partial grads (e.g. {tp_partial[0]})")
    rounded = [j.name for j in judged if j.second]
    if rounded:
        notes.append(f"{len(rounded)} grads outside the elementwise bound are as close to the fp64 gradient as the "
                     f"single-device one (rounding of a long sum, e.g. {rounded[0]})")
    if failures:
        worst.status = Status.FAIL
        notes.insert(0, f"{len(failures)} grads beyond tolerance: {problems_text(failures)}")
        worst.data["localization"] = grads.localization(judged, layout.factor_degrees())
    worst.detail = "; ".join(notes)
    return worst


def _rule(ctx: CheckContext) -> grads.Rule:
    """diffusers' strictness: a parameter the loss never reached (its reference gradient all zeros) may hold no
    gradient; a reduced-precision run is judged against the fp32 gradients; an fp32 one, where it fails, against
    the fp64 gradient (`_fp64_look`)."""
    if ctx.ref_grads32:
        return grads.Rule(zero_is_none=True, expected32=ctx.ref_grads32)
    return grads.Rule(zero_is_none=True, second_look=functools.partial(_fp64_look, ctx), marked="fp64")


def _fp64_look(ctx: CheckContext, name: str, whole, ref_grad) -> CheckResult | None:
    """An fp32 gradient beyond the elementwise bound, judged again against the fp64 gradient: it passes when it
    is no further from it than `BOUND_FACTOR` x the single-device gradient's own distance, plus one fp32 unit
    of its scale (the reduced-precision rule, `checks.compare`, with fp64 as the truth). Why: a weight
    gradient sums a term per token, and where the terms cancel the rounding of either sum is eps x sqrt(n) x
    sum |terms|, far above rtol x |g| (measured on diffusers' own LTX tester config, r2: proj_out.weight's
    element with |g| 1.6 sums 1,024 terms of total size 1,056; single-device and parallel fp32 are 2.4e-5 and
    2.2e-5 from fp64, 3.1e-5 from each other)."""
    exact = _fp64_grads(ctx).get(name)
    if exact is None:
        return None
    return compare(CheckId.GRADS, whole, ref_grad, ctx.atol, ctx.rtol, what=f"grad of {name}",
                   expected32=exact, floor=torch.finfo(ref_grad.dtype).eps)


def _fp64_grads(ctx: CheckContext) -> dict:
    """The reference model's gradients in float64 on this rank, computed only when asked, once per reference:
    consecutive cases share one (a plain case and its controls, `reference.LastReference`), and every control
    that breaks the gradients asks (75 ms a case on the bundled fixtures, a third of their gradient check)."""
    def computed() -> dict:
        from paracheck.adapters.diffusers.reference import forward, place

        model = copy.deepcopy(ctx.reference).double()
        for param in model.parameters():
            param.grad = None
        out = forward(model, place(ctx.inputs, ctx.ref_out.device, torch.float64))
        (out * ctx.weights.to(out.dtype)).sum().backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    if ctx.grads64 is None:
        # Keyed weakly by the reference model: a new reference (equal to no dead one) computes anew.
        ctx.grads64 = _FP64.get(weakref.ref(ctx.reference), computed)
    return ctx.grads64


#: The fp64 gradients of the last reference model this rank computed them for.
_FP64 = Recent(1, "diffusers fp64 grads")


def _figure(max_abs) -> str:
    return f"max_abs {max_abs:.2e}" if max_abs is not None else "max_abs n/a"


def _over(entry: GradRow) -> str:
    """How far past its bound a parameter is: its largest |a - b| / (atol + rtol |b|), > 1 beyond tolerance."""
    return f"{entry.over:.1f}x its bound" if entry.over not in (None, float("inf")) else "no bound"


@dataclass
class _Groups:
    cp: object
    tp: object


def _whole_grads(grads: dict, specs: dict, groups: _Groups, tp_partial: list[str]) -> dict:
    """Each parameter's gradient over the whole model: TP shards assembled, CP slices summed. One
    collective per group and dtype moves them all: one per parameter cost more than the checks' arithmetic."""
    from torch.distributed.tensor import DTensor

    whole, local = {}, {}
    for name, grad in grads.items():
        spec = specs.get(name)
        if isinstance(grad, DTensor) and (spec is None or spec.dim is None):
            whole[name] = grad.full_tensor()
        elif isinstance(grad, DTensor):
            local[name] = grad.to_local()
        elif groups.tp is not None:
            # Outside the plan but fed by sharded activations (QK-norms after the head split), each TP
            # rank holds a partial gradient; computed redundantly, every TP rank holds the whole one.
            local[name] = grad
        else:
            whole[name] = grad
    for name, pieces in gather_each(local, functools.partial(all_gather_pieces, group=groups.tp)).items():
        if isinstance(grads[name], DTensor):
            whole[name] = assemble(pieces, specs[name])
        elif any(not torch.equal(p, pieces[0]) for p in pieces[1:]):
            whole[name] = torch.stack(pieces).sum(0)
            tp_partial.append(name)
        else:
            whole[name] = grads[name]
    if groups.cp is not None:
        # Under CP each rank's gradient covers its slice of the sequence: sum over the CP group only.
        whole = reduce_each(whole, lambda flat: dist.all_reduce(flat, group=groups.cp))
    return whole


def cp_process_group(applied):
    if not applied.layout.has_cp:
        return None
    return library.cp_flattened_mesh(applied.parallel_config.context_parallel_config).get_group()


def all_gather_pieces(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    tensor = tensor.contiguous()
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, tensor, group=group)
    return pieces


