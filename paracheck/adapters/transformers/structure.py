"""What the plans ask of a transformers model, read from the single-process model, and the structure checks.

The expected placements come from the reference model's own plans (`tp_plan`, `ep_plan`, `fsdp_plan`, which
hold the model's defaults: a planted override on the parallel model does not change them), expanded here
to parameter and module names, so a plan entry the parallel model lost or changed shows as a wrong placement.
"""

from __future__ import annotations

import re

import torch.distributed as dist

from paracheck.checks.compare import problems_text
from paracheck.domain.records import CheckId, CheckResult, Status
from paracheck.adapters.transformers.layout import efsdp

#: TP style -> (placement type, dim from the end: -2 the output dim, -1 the input dim; None: not sharded on tp)
_TP_WEIGHT = {"colwise": ("Shard", -2), "colwise_gather_output": ("Shard", -2), "colwise_rep": ("Shard", -2),
              "rowwise": ("Shard", -1), "rowwise_split_input": ("Shard", -1), "rowwise_rep": ("Shard", -1),
              "embedding_rowwise": ("Shard", 0), "embedding_colwise": ("Shard", 1),
              "packed_colwise": ("_StridedShard", -2), "packed_rowwise": ("_StridedShard", -1),
              "replicated_with_grad_allreduce": None, "replicate": None}
#: TP styles whose module forward transformers replaces (marked `_is_hooked`).
_HOOKED = ("colwise", "colwise_gather_output", "colwise_rep", "rowwise", "rowwise_split_input", "rowwise_rep",
           "embedding_rowwise", "embedding_colwise", "replicated_with_grad_allreduce", "moe_tp_experts",
           "ep_dispatch_experts")


def wildcard(name: str) -> str:
    """`model.layers.3.mlp` -> `model.layers.*.mlp`, as transformers matches plan keys."""
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


def style_of(name: str, plan: dict, is_param: bool) -> str | None:
    """The plan's style for a parameter (its own rule, else its module's) or a module (its own rule)."""
    key = wildcard(name)
    if key in plan:
        return plan[key]
    if is_param and "." in key:
        return plan.get(key.rsplit(".", 1)[0])
    return None


def active_plans(reference, layout) -> tuple[dict, dict, dict]:
    """(tp, ep, fsdp) plans that apply on `layout`; EP rules win over TP rules on the same modules."""
    tp = dict(reference.tp_plan) if layout.tp > 1 else {}
    ep = dict(reference.ep_plan or {}) if layout.ep > 1 else {}
    fsdp = dict(reference.fsdp_plan or {}) if layout.dp > 1 else {}
    if ep and not any(style_of(name, ep, False) == "ep_dispatch_experts" for name, _ in reference.named_modules()):
        # transformers applies an EP plan only where it has experts to dispatch to (a config with its MoE block
        # off has none): its other rules are then inert, and so is the plan.
        ep = {}
    if ep:
        under_ep = re.compile(rf"(?:{'|'.join(map(re.escape, ep))})(?:\..+)?").fullmatch
        tp = {k: v for k, v in tp.items() if not under_ep(k)}
    return tp, ep, fsdp


def check_mesh(model, layout, rank: int) -> CheckResult:
    """Each parallel dimension's mesh has the layout's size, and this rank's group is the one the layout implies."""
    problems = []
    manager = getattr(model, "_mesh_manager", None)
    if manager is None:
        return CheckResult(CheckId.MESH, Status.FAIL, "the model holds no _mesh_manager")
    for dim, size in (("tp", layout.tp), ("fsdp", layout.fsdp), ("dp_replicate", layout.dpr), ("ep", layout.ep),
                      ("pp", layout.pp)):
        mesh = manager.get_mesh(dim)
        members = sorted(dist.get_process_group_ranks(mesh.get_group()))
        expected = _group(layout, rank, dim)
        if mesh.size() != size or members != expected:
            problems.append(f"{dim} mesh: size {mesh.size()} ranks {members}, expected size {size} ranks {expected}")
    return CheckResult(CheckId.MESH, Status.FAIL if problems else Status.PASS, problems_text(problems))


def _group(layout, rank: int, dim: str) -> list[int]:
    """The ranks of `rank`'s group along transformers' mesh dimension `dim`: the layout's own (`Layout.group`, over
    transformers' dense mesh), but for `ep`, which is off that mesh."""
    if dim == "ep":  # the expert mesh (pp, dp_replicate, efsdp, ep) is row-major with ep fastest
        return list(range(rank - rank % layout.ep, rank - rank % layout.ep + layout.ep))
    return layout.group(rank, ({"dp_replicate": "dpr"}.get(dim, dim),))


def check_placements(model, reference, layout) -> CheckResult:
    """Every parameter a plan names sits on its mesh dimension with the plan's placement; every planned module
    is hooked (TP, EP) or FSDP-managed."""
    tp, ep, fsdp = active_plans(reference, layout)
    params = dict(model.named_parameters())
    problems = []
    for name, ref_param in reference.named_parameters():
        param = params.get(name)
        if param is None:
            if layout.pp == 1:
                problems.append(f"{name}: missing from the parallel model")
            continue
        problems += _tp_problems(name, param, ref_param.ndim, style_of(name, tp, True))
        if style_of(name, ep, True) == "grouped_gemm":
            problems += _on(name, param, "ep", "Shard", 0)
        if fsdp:
            problems += _fsdp_problems(name, param, layout, expert=_dispatched(name, ep))
    problems += _hook_problems(model, tp, ep, fsdp)
    sharded, unapplied = tp_coverage(params, layout)
    problems += unapplied
    return CheckResult(CheckId.TP_SHARDS, Status.FAIL if problems else Status.PASS, problems_text(problems),
                       data={"parameters": len(params), "tp_sharded": sharded})


def tp_coverage(params: dict, layout) -> tuple[int, list[str]]:
    """How many parameters are split on the tp mesh, and a problem where a layout with tensor parallelism splits
    none: every module then runs whole on every rank, so every parity check passes exactly whatever the plan
    says, and the placements above (read from that same plan) expect nothing. qwen3_vl's plan splits 2 of its 376
    (the vocabulary's embedding and head), which counts."""
    sharded = sum(type(_placement(p, "tp")).__name__ in ("Shard", "_StridedShard") for p in params.values())
    if layout.tp > 1 and not sharded:
        return 0, [f"tensor parallelism applied to nothing: the layout has tp={layout.tp}, but none of the "
                   f"{len(params)} parameters is sharded on the tp mesh (the TP plan's rules split no parameter)"]
    return sharded, []


def _dispatched(name: str, ep: dict) -> bool:
    """Whether the parameter lives under a module the EP plan dispatches tokens to (`ep_dispatch_experts`): those
    are the experts transformers shards on the expert mesh (efsdp); other modules an EP plan names (gemma4 plans
    its dense MLP there too) stay on fsdp."""
    parts = name.split(".")
    return any(style_of(".".join(parts[:n]), ep, False) == "ep_dispatch_experts" for n in range(1, len(parts)))


def _tp_problems(name: str, param, ndim: int, style: str | None) -> list[str]:
    if style is None or style not in _TP_WEIGHT:
        return []
    expected = _TP_WEIGHT[style]
    if name.endswith(".bias") and style.startswith("rowwise"):
        expected = None
    if expected is None:
        # Whole on every rank: not on the tp mesh, or on it as Replicate (how transformers holds a row-parallel
        # bias, added once after the reduction). Only a shard or a pending sum breaks what the plan means.
        placement = _placement(param, "tp")
        if placement is not None and type(placement).__name__ != "Replicate":
            return [f"{name}: planned {style} (whole on every rank), but sharded on tp as {placement}"]
        return []
    kind, dim = expected
    return _on(name, param, "tp", kind, dim % ndim if dim < 0 else dim, style)


def _on(name: str, param, dim_name: str, kind: str, dim: int, style: str = "") -> list[str]:
    placement = _placement(param, dim_name)
    wanted = f"{kind}({dim})"
    if placement is None:
        return [f"{name}: planned {style or wanted} on {dim_name}, but not a DTensor on {dim_name}"]
    if type(placement).__name__ != kind or getattr(placement, "dim", None) != dim:
        return [f"{name}: planned {style or wanted} ({wanted}) on {dim_name}, placed {placement}"]
    return []


def _fsdp_problems(name: str, param, layout, expert: bool) -> list[str]:
    dim_name = "efsdp" if expert else "fsdp"
    size = efsdp(layout) if expert else layout.fsdp
    problems = []
    if size > 1:
        placement = _placement(param, dim_name)
        if placement is None or type(placement).__name__ not in ("Shard", "_StridedShard") or placement.dim != 0:
            problems.append(f"{name}: FSDP shards it on {dim_name} dim 0, placed {placement}")
    if layout.dpr > 1 and type(_placement(param, "dp_replicate")).__name__ != "Replicate":
        problems.append(f"{name}: HSDP replicates it on dp_replicate, placed {_placement(param, 'dp_replicate')}")
    return problems


def _hook_problems(model, tp: dict, ep: dict, fsdp: dict) -> list[str]:
    from torch.distributed.fsdp import FSDPModule

    problems = []
    for name, module in model.named_modules():
        style = style_of(name, {**tp, **ep}, False)
        if style in _HOOKED and not getattr(module, "_is_hooked", False):
            problems.append(f"{name}: planned {style}, but transformers' hook is not installed")
        if name and style_of(name, fsdp, False) and not isinstance(module, FSDPModule) and not _tied_head(model, module):
            problems.append(f"{name}: in the fsdp_plan, but not FSDP-managed")
    return problems


def _dims(param) -> tuple:
    mesh = getattr(param, "device_mesh", None)
    return tuple(mesh.mesh_dim_names or ()) if mesh is not None else ()


def _placement(param, dim_name: str):
    dims = _dims(param)
    return param.placements[dims.index(dim_name)] if dim_name in dims else None


def _tied_head(model, module) -> bool:
    """Whether `module` is the output head and holds the input embedding's own weight: transformers wraps a tied
    pair once, on the embedding (`distributed.fsdp._resolve_tied_embed_lm_head_plan`), so the head is not an
    FSDP module of its own."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    return module is head and head is not None and embed is not None and head.weight is embed.weight
