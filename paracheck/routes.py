"""Routes: the ways a model gets parallelized, each ending in the same `Applied` record for the checks.

- native: the library's own `enable_parallelism(config=ParallelConfig(...))`.
- composed: one shared ("tp", "ring", "ulysses") mesh, the CP config given the whole mesh and the TP
  config its "tp" dimension, then the library's own `apply_context_parallel` and `apply_tensor_parallel`.
  It exists because diffusers 0.42's `ParallelConfig` refuses TP and CP together.
- sharded-load: `from_pretrained(..., parallel_config=...)` on a safetensors checkpoint rank 0 writes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .backends import Backend, shims
from .controls import plant
from .fitting import Unfittable
from .layout import Layout

REFUSES_BOTH = (
    "diffusers' ParallelConfig refuses tensor and context parallelism together, and from_pretrained "
    "takes no other way in"
)


@dataclass
class Applied:
    route: str
    layout: Layout
    rank: int
    parallel_config: object
    #: The meshes the library holds: name -> DeviceMesh ("cp" and/or "tp").
    meshes: dict


def library_accepts(layout: Layout) -> bool:
    """Whether the installed diffusers takes this layout in one `ParallelConfig`."""
    try:
        _parallel_config(layout)
    except ValueError:
        return False
    return True


def resolve_route(route: str, layout: Layout) -> str:
    if route != "auto":
        return route
    return "native" if library_accepts(layout) else "composed"


def apply(route: str, model, layout: Layout, backend: Backend, control: str | None, reference, workdir: str):
    """Parallelize `model` (a copy of `reference`) and plant `control`; returns (model, Applied)."""
    rank = dist.get_rank()
    if route == "native":
        with shims(backend):
            model.enable_parallelism(config=_parallel_config(layout))
        applied = _applied("native", model, layout, rank)
    elif route == "composed":
        applied = _composed(model, layout, backend, rank, swap_order=control == "swapped-mesh-order")
    elif route == "sharded-load":
        model = _sharded_load(reference, layout, backend, workdir)
        applied = _applied("sharded-load", model, layout, rank)
    else:
        raise ValueError(f"route {route!r}: must be one of native, composed, sharded-load")
    if control:
        plant(control, model, applied, reference.state_dict())
    return model, applied


def _parallel_config(layout: Layout):
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig, TensorParallelConfig

    cp = ContextParallelConfig(ring_degree=layout.ring, ulysses_degree=layout.ulysses) if layout.has_cp else None
    tp = TensorParallelConfig(tp_degree=layout.tp) if layout.has_tp else None
    return ParallelConfig(context_parallel_config=cp, tensor_parallel_config=tp)


def _applied(route: str, model, layout: Layout, rank: int) -> Applied:
    config = model._parallel_config
    meshes = {}
    if config.context_parallel_config is not None:
        meshes["cp"] = config.context_parallel_config._mesh
    if config.tensor_parallel_config is not None:
        meshes["tp"] = config.tensor_parallel_config._mesh
    return Applied(route, layout, rank, config, meshes)


def _composed(model, layout: Layout, backend: Backend, rank: int, swap_order: bool) -> Applied:
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.hooks.tensor_parallel import apply_tensor_parallel
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig, TensorParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    from .checks import attention_processors

    order = layout.order
    if swap_order:
        order = "tp-fastest" if order == "cp-fastest" else "cp-fastest"
    mesh_layout = Layout(layout.tp, layout.ring, layout.ulysses, order)
    mesh = init_device_mesh(backend.device_type, mesh_layout.mesh_shape, mesh_dim_names=mesh_layout.mesh_dims)
    device = torch.device(backend.device_for(int(os.environ.get("LOCAL_RANK", rank))))
    world = dist.get_world_size()

    cp = tp = None
    if layout.has_cp:
        cp = ContextParallelConfig(ring_degree=layout.ring, ulysses_degree=layout.ulysses, mesh=mesh)
        cp.setup(rank, world, device, mesh)
    if layout.has_tp:
        tp = TensorParallelConfig(mesh=mesh["tp"])
        tp.setup(rank, world, device, mesh["tp"])
    # Built with one part, then given the other: its constructor refuses both at once.
    config = ParallelConfig(context_parallel_config=cp) if cp else ParallelConfig(tensor_parallel_config=tp)
    config.context_parallel_config, config.tensor_parallel_config = cp, tp
    config._rank, config._world_size, config._device, config._mesh = rank, world, device, mesh
    model._parallel_config = config

    if cp is not None:
        for _, processor in attention_processors(model):
            processor._parallel_config = config
        apply_context_parallel(model, cp, model._cp_plan)
    if tp is not None:
        with shims(backend):
            apply_tensor_parallel(model, tp, model._tp_plan)
    meshes = {k: v for k, v in (("cp", mesh if cp else None), ("tp", mesh["tp"] if tp else None)) if v is not None}
    return Applied("composed", layout, rank, config, meshes)


def _sharded_load(reference, layout: Layout, backend: Backend, workdir: str):
    if layout.has_tp and layout.has_cp and not library_accepts(layout):
        raise Unfittable(REFUSES_BOTH)
    checkpoint = os.path.join(workdir, "checkpoint")
    if dist.get_rank() == 0:
        reference.save_pretrained(checkpoint, safe_serialization=True)
    dist.barrier()
    with shims(backend):
        model = type(reference).from_pretrained(checkpoint, parallel_config=_parallel_config(layout),
                                                low_cpu_mem_usage=True)
    return model.eval()
