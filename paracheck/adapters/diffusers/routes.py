"""Routes: the ways a model gets parallelized, each ending in the same `Applied` record for the checks.

- native: the library's own `enable_parallelism(config=ParallelConfig(...))`, its configs handed the world's
  meshes (`meshes.Meshes`: the ones the library would build, made once per world, not once per case).
- composed: one shared ("tp", "ring", "ulysses") mesh, the CP config given the whole mesh and the TP
  config its "tp" dimension, then the library's own `apply_context_parallel` and `apply_tensor_parallel`.
  It exists because diffusers 0.42's `ParallelConfig` refuses TP and CP together.
- sharded-load: `from_pretrained(..., parallel_config=...)` on a safetensors checkpoint rank 0 writes.
- neuron-tp: native or composed (as auto picks) through diffusers' Neuron TP path (`_apply_tp_neuron`); on a CPU
  world the kit stands in for the Neuron device only (`library.neuron_tensor_parallel`), and says so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from paracheck.adapters.diffusers import library
from paracheck.adapters.diffusers.fitting import Unfittable
from paracheck.adapters.diffusers.layout import CP_DIMS
from paracheck.domain.layout import Layout
from paracheck.world.meshes import for_world
from paracheck.domain.records import Route

REFUSES_BOTH = (
    "diffusers' ParallelConfig refuses tensor and context parallelism together, and from_pretrained "
    "takes no other way in"
)


@dataclass
class Applied:
    route: Route
    layout: Layout
    rank: int
    parallel_config: object
    #: The meshes the library holds: "cp" and/or "tp" -> DeviceMesh.
    meshes: dict
    #: What the kit stood in for of the library's path (`library.NEURON_STOOD_IN`'s shape), None: nothing.
    stood_in: dict | None = None


def resolve_route(route: Route, layout: Layout, device_type: str) -> Route:
    """The route a case runs through; `Unfittable` where `neuron-tp` cannot run on `device_type` (the backend's:
    no default, so no caller gets the CPU stand-in without saying it runs on the CPU)."""
    if route == Route.NEURON_TP:
        refused = _neuron_tp_refused(layout, device_type)
        if refused:
            raise Unfittable(refused)
    if route != Route.AUTO:
        return route
    return Route.NATIVE if library.library_accepts(layout) else Route.COMPOSED


def _neuron_tp_refused(layout: Layout, device_type: str) -> str | None:
    if not layout.has_tp:
        return f"layout {layout} has no tensor parallelism for the neuron-tp route"
    if device_type not in ("cpu", "neuron"):
        return f"the neuron-tp route runs on Neuron devices or on a CPU world (stood in), not on {device_type}"
    return library.neuron_tp_missing()


def apply(route: Route, model, layout: Layout, backend, control, reference, workdir: str, cp_options: tuple = ()):
    """Parallelize `model` (a copy of `reference`) and plant `control`; returns (model, Applied)."""
    if route == Route.NEURON_TP:
        model, applied = _neuron_tp(model, layout, backend, control, reference, workdir, cp_options)
    else:
        model, applied = _parallelize(route, model, layout, backend, control, reference, workdir, cp_options)
    if control:
        from paracheck.world.regions import as_control_asks

        as_control_asks(control.per_rank, control.plant, model, applied, reference.state_dict())
    return model, applied


def _neuron_tp(model, layout: Layout, backend, *rest):
    """`auto`'s route through the Neuron TP path; on a CPU world inside the kit's stand-in for the device only.
    `Applied.route` stays the route that ran (native / composed), so the structure checks judge it as such."""
    inner = resolve_route(Route.AUTO, layout, backend.device_type)
    if backend.device_type != "cpu":
        return _parallelize(inner, model, layout, backend, *rest)
    with library.neuron_tensor_parallel():
        model, applied = _parallelize(inner, model, layout, backend, *rest)
    applied.stood_in = library.NEURON_STOOD_IN
    return model, applied


def _parallelize(route: Route, model, layout: Layout, backend, control, reference, workdir: str, cp_options: tuple):
    rank = dist.get_rank()
    if route == Route.NATIVE:
        with library.shims(backend.device_type), library.entry_point("enable_parallelism", route.value):
            model.enable_parallelism(config=_library_config(layout, backend, cp_options))
        applied = _applied(route, model, layout, rank)
    elif route == Route.COMPOSED:
        order = control.order_for(layout.order) if control else layout.order
        applied = _composed(model, layout, backend, rank, order, cp_options)
    elif route == Route.SHARDED_LOAD:
        model = _sharded_load(reference, layout, backend, workdir, cp_options)
        applied = _applied(route, model, layout, rank)
    else:
        raise ValueError(f"route {route!r}: must be one of native, composed, sharded-load, neuron-tp")
    return model, applied


def _applied(route: Route, model, layout: Layout, rank: int) -> Applied:
    config = library.parallel_config(model)
    meshes = {}
    if config.context_parallel_config is not None:
        meshes["cp"] = library.config_mesh(config.context_parallel_config)
    if config.tensor_parallel_config is not None:
        meshes["tp"] = library.config_mesh(config.tensor_parallel_config)
    return Applied(route, layout, rank, config, meshes)


def _library_config(layout: Layout, backend, cp_options: tuple):
    """The library's config for `layout`, handed the meshes it would build, as this world's `Meshes` hold them."""
    library.make_parallel_config(layout, cp_options)  # refused before any mesh is built for it
    world = for_world()
    return library.make_parallel_config(
        layout, cp_options, cp_mesh=world.along(layout, CP_DIMS, backend.device_type) if layout.has_cp else None,
        tp_mesh=world.along(layout, ("tp",), backend.device_type) if layout.has_tp else None)


def _composed(model, layout: Layout, backend, rank: int, order: str, cp_options: tuple) -> Applied:
    mesh = for_world().shared(layout, backend.device_type, order)
    # On the CPU every rank's device is the same one, so the rank is not read (in a local world it differs).
    device = torch.device("cpu" if backend.device_type == "cpu" else backend.device_for(
        int(os.environ.get("LOCAL_RANK", rank))))
    config = library.composed_config(layout, mesh, rank, dist.get_world_size(), device, cp_options)
    library.attach(model, config)
    if config.context_parallel_config is not None:
        with library.entry_point("apply_context_parallel", Route.COMPOSED.value):
            library.apply_context_parallel(model, config.context_parallel_config)
    if config.tensor_parallel_config is not None:
        with library.shims(backend.device_type), library.entry_point("apply_tensor_parallel", Route.COMPOSED.value):
            library.apply_tensor_parallel(model, config.tensor_parallel_config)
    meshes = {"cp": mesh} if layout.has_cp else {}
    if layout.has_tp:
        meshes["tp"] = mesh["tp"]
    return Applied(Route.COMPOSED, layout, rank, config, meshes)


def _sharded_load(reference, layout: Layout, backend, workdir: str, cp_options: tuple):
    if layout.has_tp and layout.has_cp and not library.library_accepts(layout):
        raise Unfittable(REFUSES_BOTH)
    checkpoint = os.path.join(workdir, "checkpoint")
    if dist.get_rank() == 0:
        reference.save_pretrained(checkpoint, safe_serialization=True)
    dist.barrier()
    with library.shims(backend.device_type), library.entry_point("from_pretrained", Route.SHARDED_LOAD.value):
        model = type(reference).from_pretrained(checkpoint, parallel_config=_library_config(layout, backend, cp_options),
                                                low_cpu_mem_usage=True)
    return model.eval()
