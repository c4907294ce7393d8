"""Checks: structure and numbers, computed on every rank against a reference built in the same process.

Each check returns one `CheckResult` for this rank; the report merges ranks and names the failing ones.
The stable ids are in CONTRACT.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from .layout import Layout

CHECK_IDS = (
    "structure.mesh",
    "structure.cp_hooks",
    "structure.processor_config",
    "structure.tp_shards",
    "parity.forward",
    "parity.grads",
)

# (atol, rtol) by dtype and device type. fp32 on CPU agrees to ~1e-7 on the fixtures (measured), so
# these leave two orders of magnitude of headroom and still fail a 3e-2 shift by three.
_TOLERANCES = {
    (torch.float32, "cpu"): (1e-5, 1e-5),
    (torch.float32, "cuda"): (1e-4, 1e-4),
    (torch.float32, "neuron"): (2e-4, 2e-4),
    (torch.bfloat16, None): (2e-2, 2e-2),
    (torch.float16, None): (2e-3, 2e-3),
}


@dataclass
class CheckResult:
    id: str
    status: str  # pass | fail | skip
    detail: str = ""
    max_abs: float | None = None
    max_rel: float | None = None
    atol: float | None = None
    rtol: float | None = None

    def to_json(self) -> dict:
        return asdict(self)


def tolerance(dtype: torch.dtype, device_type: str) -> tuple[float, float]:
    for key in ((dtype, device_type), (dtype, None)):
        if key in _TOLERANCES:
            return _TOLERANCES[key]
    return _TOLERANCES[(torch.float32, "cuda")]


def compare(check_id: str, actual, expected, atol: float, rtol: float, what: str = "output") -> CheckResult:
    """Shape, finiteness, then |a - b| <= atol + rtol * |b| elementwise; max_rel is relative to max |b|."""
    if tuple(actual.shape) != tuple(expected.shape):
        return CheckResult(check_id, "fail", f"{what} shape {tuple(actual.shape)} != reference {tuple(expected.shape)}")
    actual, expected = actual.detach().double(), expected.detach().double()
    if not torch.isfinite(actual).all():
        return CheckResult(check_id, "fail", f"{what} has non-finite values", atol=atol, rtol=rtol)
    diff = (actual - expected).abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    max_rel = max_abs / max(float(expected.abs().max()) if expected.numel() else 0.0, 1e-12)
    ok = bool((diff <= atol + rtol * expected.abs()).all())
    detail = "" if ok else f"{what} differs from the single-device reference"
    return CheckResult(check_id, "pass" if ok else "fail", detail, max_abs, max_rel, atol, rtol)


# -- helpers shared with routes and controls ---------------------------------------------------


def attention_processors(model) -> list[tuple[str, object]]:
    """Attention processors that take a parallel config (they have a `_parallel_config` slot)."""
    found = []
    for name, module in model.named_modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_parallel_config"):
            found.append((name, processor))
    return found


def tp_specs(model, tp_degree: int) -> dict:
    from diffusers.hooks.tensor_parallel import resolve_tp_shard_specs

    return resolve_tp_shard_specs(model, model._tp_plan, tp_degree)


def local_slice(full: torch.Tensor, spec, index: int, tp: int) -> torch.Tensor:
    """Shard `index` of `tp` of a planned parameter: each block of `spec.dim` is split on its own."""
    if spec.dim is None:
        return full
    parts, offset = [], 0
    for block in spec.block_sizes:
        chunk = block // tp
        parts.append(full.narrow(spec.dim, offset + index * chunk, chunk))
        offset += block
    return torch.cat(parts, dim=spec.dim)


def assemble(pieces: list[torch.Tensor], spec) -> torch.Tensor:
    """Inverse of `local_slice`: the full tensor from every TP rank's shard, in TP-coordinate order."""
    tp = len(pieces)
    blocks = []
    offset = 0
    for block in spec.block_sizes:
        chunk = block // tp
        blocks.extend(p.narrow(spec.dim, offset, chunk) for p in pieces)
        offset += chunk
    return torch.cat(blocks, dim=spec.dim)


def group_ranks(mesh, dim: str | None = None) -> list[int]:
    group = mesh.get_group(dim) if dim else mesh.get_group()
    return sorted(dist.get_process_group_ranks(group))


def _summary(items: list[str], limit: int = 3) -> str:
    more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
    return "; ".join(items[:limit]) + more


# -- structure ---------------------------------------------------------------------------------


def check_mesh(applied) -> CheckResult:
    layout: Layout = applied.layout
    rank = applied.rank
    coords = layout.coords(rank)
    problems = []
    expected = {}
    if layout.has_cp:
        expected["cp"] = (("ring", "ulysses"), layout.cp_group(rank))
    if layout.has_tp:
        expected["tp"] = (("tp",), layout.tp_group(rank))
    if applied.route == "composed":
        shared = applied.parallel_config._mesh
        got = (tuple(shared.mesh_dim_names or ()), tuple(shared.shape))
        if got != (layout.mesh_dims, layout.mesh_shape):
            problems.append(f"shared mesh {got} != layout's {(layout.mesh_dims, layout.mesh_shape)}")
    for part, (dims, members) in expected.items():
        mesh = applied.meshes.get(part)
        if mesh is None:
            problems.append(f"no {part} mesh")
            continue
        names = tuple(mesh.mesh_dim_names or ())
        for dim in dims:
            if dim not in names:
                problems.append(f"{part} mesh lacks dim {dim!r}")
                continue
            size = mesh.size(names.index(dim))
            if size != getattr(layout, dim):
                problems.append(f"{part} mesh dim {dim} has size {size}, layout says {getattr(layout, dim)}")
            local = mesh.get_local_rank(dim)
            if local != coords[dim]:
                problems.append(f"rank {rank} sits at {dim}={local}, layout says {coords[dim]}")
        if all(d in names for d in dims):
            got = _library_group(applied, part)
            if got != members:
                problems.append(f"{part} group {got} != layout's {members}")
    return CheckResult("structure.mesh", "fail" if problems else "pass", _summary(problems))


def _library_group(applied, part: str) -> list[int]:
    """The ranks the library will actually communicate with for `part`."""
    if part == "cp":
        return group_ranks(applied.parallel_config.context_parallel_config._flattened_mesh)
    return group_ranks(applied.meshes["tp"], "tp")


def _plan_modules(model, module_id: str) -> list:
    """Modules a `_cp_plan` key names; `*` expands over a ModuleList (resolved here, not by diffusers)."""
    modules = [model]
    for atom in [a for a in module_id.split(".") if a] if module_id else []:
        nxt = []
        for module in modules:
            if atom == "*":
                nxt.extend(list(module))
            else:
                nxt.append(getattr(module, atom))
        modules = nxt
    return modules


def check_cp_hooks(model, layout: Layout) -> CheckResult:
    problems = []
    if layout.has_cp:
        for module_id, entry in model._cp_plan.items():
            kind = "cp_input" if isinstance(entry, dict) else "cp_output"
            hook = f"{kind}---{module_id}"
            for module in _plan_modules(model, module_id):
                registry = getattr(module, "_diffusers_hook", None)
                if registry is None or hook not in registry.hooks:
                    problems.append(f"{module_id or '<root>'} lacks {hook}")
    else:
        for name, module in model.named_modules():
            registry = getattr(module, "_diffusers_hook", None)
            stray = [h for h in (registry.hooks if registry else {}) if h.startswith(("cp_input---", "cp_output---"))]
            problems.extend(f"{name or '<root>'} carries {h} without CP" for h in stray)
    return CheckResult("structure.cp_hooks", "fail" if problems else "pass", _summary(problems))


def check_processor_config(model, applied) -> CheckResult:
    layout = applied.layout
    processors = attention_processors(model)
    problems = []
    if layout.has_cp:
        if not processors:
            problems.append("no attention processor takes a parallel config, so attention cannot run Ulysses/ring")
        for name, processor in processors:
            config = processor._parallel_config
            cp = getattr(config, "context_parallel_config", None)
            if config is None or cp is None:
                problems.append(f"{name}: processor holds no CP config")
            elif config is not applied.parallel_config:
                problems.append(f"{name}: processor holds another config than the run's")
            elif (cp.ring_degree, cp.ulysses_degree) != (layout.ring, layout.ulysses):
                problems.append(f"{name}: CP degrees {(cp.ring_degree, cp.ulysses_degree)} != layout's")
    else:
        problems.extend(
            f"{name}: TP alone, yet processor holds a parallel config" for name, p in processors
            if p._parallel_config is not None
        )
    return CheckResult("structure.processor_config", "fail" if problems else "pass", _summary(problems))


def check_tp_shards(model, reference, applied) -> CheckResult:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    layout = applied.layout
    params = dict(model.named_parameters())
    ref_state = dict(reference.named_parameters())
    problems = []
    planned = tp_specs(reference, layout.tp) if layout.has_tp else {}
    if layout.has_tp:
        index = layout.coords(applied.rank)["tp"]
        members = layout.tp_group(applied.rank)
        for name, spec in planned.items():
            param = params.get(name)
            if not isinstance(param, DTensor):
                problems.append(f"{name} is not a DTensor")
                continue
            if group_ranks(param.device_mesh) != members:
                problems.append(f"{name} lives on ranks {group_ranks(param.device_mesh)}, TP group is {members}")
            want = Replicate() if spec.dim is None else Shard(spec.dim)
            if tuple(param.placements) != (want,):
                problems.append(f"{name} placed {param.placements}, plan says {want}")
                continue
            expected = local_slice(ref_state[name].detach(), spec, index, layout.tp)
            local = param.to_local()
            if local.shape != expected.shape or not torch.equal(local, expected):
                problems.append(f"{name} local tensor is not TP shard {index} of {layout.tp}")
    for name, param in params.items():
        if name in planned:
            continue
        if isinstance(param, DTensor):
            problems.append(f"{name} is outside the TP plan but is a DTensor")
        elif not torch.equal(param.detach(), ref_state[name].detach()):
            problems.append(f"{name} is outside the TP plan but differs from the reference")
    return CheckResult("structure.tp_shards", "fail" if problems else "pass", _summary(problems))


# -- numbers -----------------------------------------------------------------------------------


def check_grads(model, reference, applied, atol: float, rtol: float) -> CheckResult:
    """Reassemble every gradient, then compare with the reference's; reports the worst parameter."""
    from torch.distributed.tensor import DTensor

    layout = applied.layout
    specs = tp_specs(reference, layout.tp) if layout.has_tp else {}
    cp_group = _cp_process_group(applied)
    tp_group = applied.meshes["tp"].get_group() if layout.has_tp else None
    ref_params = dict(reference.named_parameters())
    worst = CheckResult("parity.grads", "pass", atol=atol, rtol=rtol, max_abs=0.0, max_rel=0.0)
    failures, tp_partial = [], []
    for name, param in sorted(model.named_parameters()):
        ref_grad = ref_params[name].grad
        grad = param.grad
        if grad is None:
            # Every rank takes the same branch: a missing grad comes from the model's structure.
            if ref_grad is not None and bool(ref_grad.abs().max() > 0):
                why = "" if param.requires_grad else " (requires_grad=False)"
                failures.append(f"{name} has no gradient{why}")
            continue
        if isinstance(grad, DTensor):
            spec = specs.get(name)
            if spec is not None and spec.dim is not None:
                grad = assemble(_all_gather(grad.to_local(), tp_group), spec)
            else:
                grad = grad.full_tensor()
        elif tp_group is not None:
            # Outside the plan but fed by sharded activations (QK-norms after the head split), each TP
            # rank holds a partial gradient; computed redundantly, every TP rank holds the whole one.
            pieces = _all_gather(grad, tp_group)
            if any(not torch.equal(p, pieces[0]) for p in pieces[1:]):
                grad = torch.stack(pieces).sum(0)
                tp_partial.append(name)
        if cp_group is not None:
            # Under CP each rank's gradient covers its slice of the sequence: sum over the CP group only.
            grad = grad.clone()
            dist.all_reduce(grad, group=cp_group)
        if ref_grad is None:
            failures.append(f"{name} has a gradient the reference lacks")
            continue
        result = compare("parity.grads", grad, ref_grad, atol, rtol, what=f"grad of {name}")
        if result.status == "fail":
            failures.append(f"{name} (max_abs {result.max_abs if result.max_abs is not None else 'n/a'})")
        if result.max_abs is not None and result.max_abs >= (worst.max_abs or 0.0):
            worst.max_abs, worst.max_rel, worst.detail = result.max_abs, result.max_rel, f"worst: {name}"
    notes = [worst.detail] if worst.detail else []
    if tp_partial:
        notes.append(f"{len(tp_partial)} params outside the TP plan have TP-partial grads (e.g. {tp_partial[0]})")
    if failures:
        worst.status = "fail"
        notes.insert(0, f"{len(failures)} grads differ: {_summary(failures)}")
    worst.detail = "; ".join(notes)
    return worst


def _cp_process_group(applied):
    if not applied.layout.has_cp:
        return None
    return applied.parallel_config.context_parallel_config._flattened_mesh.get_group()


def _all_gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    tensor = tensor.contiguous()
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, tensor, group=group)
    return pieces
