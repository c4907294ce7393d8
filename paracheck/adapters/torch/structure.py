"""The torch adapter's structure checks on a parallelized user module: the mesh, and every parameter's shard.

`structure.mesh`: the mesh the spec was handed has the layout's dimensions and sizes, every DTensor parameter
lives on that mesh (or a slice of it, sizes matching), and a layout with TP (or FSDP) has at least one parameter
sharded on that dimension: a parallelize that did nothing computes the right numbers, redundantly.
`structure.tp_shards`: every DTensor parameter's local shard is the slice of the reference parameter that its
placements and this rank's mesh coordinate name (torch's own slicing, `distribute_tensor(..., src_data_rank=None)`,
which moves nothing); a parameter that is no DTensor equals the reference's; one named on one side only is named
as that. Names are read through the wrappers torch puts around modules (`names`).
"""

from __future__ import annotations

from paracheck.checks.compare import problems_text
from paracheck.domain.records import CheckId, CheckResult, Status


def check_mesh(mesh, layout, params: dict) -> CheckResult:
    """`params`: the parallel model's by clean name (`names.parameters`)."""
    from torch.distributed.tensor import DTensor

    problems = []
    dims, shape = tuple(mesh.mesh_dim_names or ()), tuple(mesh.mesh.shape)
    if dims != layout.mesh_dims or shape != layout.mesh_shape:
        problems.append(f"mesh {dict(zip(dims, shape))} != layout {layout.name}'s {dict(zip(layout.mesh_dims, layout.mesh_shape))}")
    sizes = dict(zip(layout.mesh_dims, layout.mesh_shape))
    sharded: set[str] = set()
    for name, param in params.items():
        if not isinstance(param, DTensor):
            continue
        dims, shape = tuple(param.device_mesh.mesh_dim_names or ()), tuple(param.device_mesh.mesh.shape)
        # A dimension of size 1 divides nothing (torchtitan keeps "pp" and "dp_replicate" of degree 1 in its mesh).
        wrong = [d for d, n in zip(dims, shape) if n > 1 and sizes.get(d) != n and not _flattened(set(sizes), d)]
        if wrong or not dims:
            problems.append(f"{name}: on mesh {dict(zip(dims, shape))}, not a slice of the layout's")
        sharded |= {d for d, p in zip(dims, param.placements) if p.is_shard()}
    for token in ("tp", "fsdp"):
        if getattr(layout, token) > 1 and token not in sharded and not _flattened(sharded, token):
            problems.append(f"no parameter is sharded on the {token} dimension")
    return _result(CheckId.MESH, problems, "mesh")


def _flattened(names: set[str], token: str) -> bool:
    """A flattened dimension (`dp_fsdp`) counts for its parts, and a part for it."""
    return any(token in d.split("_") or d in token.split("_") for d in names)


def check_shards(params: dict, reference: dict, atol: float, rtol: float, held: set | None = None) -> CheckResult:
    """Every parameter's local values against the slice of the reference its placements name (`params` by clean
    name; `held`: the names some rank holds, where each holds a part: a pipeline's stages)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    problems, worst, count = [], 0.0, 0
    problems += [f"{name}: in the reference only" for name in reference if name not in params
                 and name not in (held or ())]
    problems += [f"{name}: in the parallel model only" for name in params if name not in reference]
    for name, param in params.items():
        want = reference.get(name)
        if want is None:
            continue
        if isinstance(param, DTensor):
            count += 1
            if tuple(param.shape) != tuple(want.shape):
                problems.append(f"{name}: global shape {tuple(param.shape)} != reference {tuple(want.shape)}")
                continue
            want = distribute_tensor(want.to(param.device), param.device_mesh, param.placements,
                                     src_data_rank=None).to_local()
            have = param.to_local()
        else:
            have = param
        if tuple(have.shape) != tuple(want.shape):
            problems.append(f"{name}: local shape {tuple(have.shape)} != its slice {tuple(want.shape)}")
            continue
        diff = float((have.detach().double().cpu() - want.detach().double().cpu()).abs().max()) if have.numel() else 0.0
        worst = max(worst, diff)
        if diff > atol + rtol * float(want.abs().max() if want.numel() else 0.0):
            problems.append(f"{name}: local shard off by {diff:.1e} from the slice its placements name")
    result = _result(CheckId.TP_SHARDS, problems, "shards")
    result.max_abs, result.atol, result.rtol = worst, atol, rtol
    result.data = {"dtensor_params": count, **result.data}
    return result


def _result(check_id, problems: list[str], what: str) -> CheckResult:
    if problems:
        return CheckResult(check_id, Status.FAIL, f"{what}: {problems_text(problems)}", data={"failing": len(problems)})
    return CheckResult(check_id, Status.PASS)
