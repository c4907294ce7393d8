"""The fake-world mechanics of a simulation: this process as any rank of torch's fake process group, and
models and inputs on the meta device.

Under the fake group (`backend="fake"`) collectives move nothing; on meta, tensors hold no values. So one
process can stand in for every rank of a large world in turn, and build what the library builds there.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings

import torch
import torch.distributed as dist

#: Modules whose `reset_parameters` `build_meta` skips: on meta an initializer writes nothing anyway, and
#: skipping them builds full-size Flux about 2.5x faster (measured: 0.27 s -> 0.10 s).
_INITIALIZED = ("Linear", "Conv1d", "Conv2d", "Conv3d", "Embedding", "LayerNorm", "RMSNorm", "GroupNorm")


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
def quiet():
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
