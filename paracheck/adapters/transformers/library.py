"""The one place that reaches into transformers' private attributes: handing `from_pretrained` the world's meshes,
building a `Trainer` for a tensor-parallel model on a CPU world, and the functions a local world runs once per rank
(`PER_RANK`, `per_rank_regions`; weights loaded in the calling thread, `SYNC_LOAD`).

`from_pretrained(distributed_config=...)` takes no mesh: its `device_mesh` argument is overwritten when a
`DistributedConfig` is given, and `initialize_distributed_mesh` (called from
`transformers.distributed.mixin`) builds a dense `(pp, dp_replicate, fsdp, tp)` and an expert
`(pp, dp_replicate, efsdp, ep)` mesh with `init_device_mesh` on every call: six to eight new process groups
per load, three gloo threads each. They cannot simply be destroyed after a case: DTensor's sharding
propagation caches (Python and C++) key on meshes by equality and keep the first case's output specs, whose
mesh names the first case's groups, so the next load of an equal layout resolves destroyed groups
("Could not resolve the process group registered under the name 9"); and clearing those caches still left
the destroyed groups' threads alive (measured: +12 threads per load).

So within `world_meshes` that one function is replaced by one that returns the world's meshes
(`paracheck.world.meshes.Meshes.from_groups`): one per shape, over one process group per distinct rank set.
Where the seam is missing (another transformers release) nothing is replaced and transformers builds its own.
"""

from __future__ import annotations

import contextlib
import math

import torch.distributed as dist

from paracheck.world.meshes import MeshKey

#: The module whose global `from_pretrained` calls (through `prepare_distribute_model`) to build its meshes.
SEAM_MODULE = "transformers.distributed.mixin"
SEAM = "initialize_distributed_mesh"
DENSE_DIMS = ("pp", "dp_replicate", "fsdp", "tp")
EXPERT_DIMS = ("pp", "dp_replicate", "efsdp", "ep")


@contextlib.contextmanager
def world_meshes(meshes, device_type: str, device):
    """Within: every `from_pretrained(distributed_config=...)` gets its dense and expert meshes from `meshes`
    (a `Meshes`), on `device_type`, and `device` as its device map, instead of building new ones."""
    import importlib

    module = importlib.import_module(SEAM_MODULE)
    original = getattr(module, SEAM, None)
    if not callable(original):
        yield False
        return
    setattr(module, SEAM, _initialize(meshes, device_type, device, original))
    try:
        yield True
    finally:
        setattr(module, SEAM, original)


def _initialize(meshes, device_type: str, device, original):
    from transformers.distributed.utils import TransformersDeviceMesh

    def initialize(config):
        dense = (config.pp_size, config.dp_replicate_size, config.fsdp_size, config.tp_size)
        if dense == (1, 1, 1, 1) or math.prod(dense) != dist.get_world_size():
            return original(config)  # transformers' own answer: no mesh, or its error naming the sizes
        expert = (config.pp_size, config.dp_replicate_size, config.efsdp_size, config.ep_size)
        manager = TransformersDeviceMesh(meshes.from_groups(MeshKey(device_type, dense, DENSE_DIMS)),
                                         meshes.from_groups(MeshKey(device_type, expert, EXPERT_DIMS)))
        return device, manager

    return initialize


@contextlib.contextmanager
def trainer_without_tp(model):
    """Within: the model reads as not tensor-parallel (`model.tp_size` is None), so a `Trainer` built here hands
    accelerate no `ParallelismConfig`, which accelerate refuses on a CPU world. The degree comes back after: the
    Trainer reads it (`get_tp_size`, from `model._tp_size`) for its loss scale and token count while it trains."""
    saved = model._tp_size
    model._tp_size = None
    try:
        yield
    finally:
        model._tp_size = saved


# -- a local world (`--local-world`) --------------------------------------------------------------------------------

#: transformers' functions whose Python differs between ranks, each run per rank in a local world (`world.regions`),
#: as the diffusers adapter's `PER_RANK`: (module, attribute path, kind, why).
PER_RANK = (
    ("transformers.distributed.sharding_utils", "DtensorShardOperation.shard_tensor", "function",
     "slices a checkpoint tensor by this rank's coordinate on each sharded mesh dimension (sub_mesh.get_local_rank())"),
    ("transformers.distributed.mixin", "DistributedMixin._validate_parallel_plan", "function",
     "warns of plan rules that match nothing on rank 0 only (`_get_torch_distributed_rank() == 0`, mixin.py:206): "
     "qwen3_moe's tp4 plan names its experts' rules, so every qwen3_moe case raised RankDependent there"),
)


#: Why one process cannot run expert parallelism as every rank (`Adapter.local_limit`), measured on qwen3_moe at
#: 4 ranks before this was a skip: each rank loads only its own experts (`shard_tensor` gives the others' `None`,
#: filtered out in `WeightConverter.materialize_tensors`, core_model_loading.py:1144: a list whose length and
#: members differ between ranks; `fsdp4xep4` raised there), and under gradients `AutoEP` runs `AllToAllEP`, whose
#: ranks receive a routing-dependent number of tokens (the split sizes read back by `.tolist()`,
#: expert_parallel.py:225), tensors of different shapes on each rank. (The mask at expert_parallel.py:290, by
#: `ep_mesh.get_local_rank()`, is not the blocker: under the mode it is each rank's own coordinate.)
EP_LOCAL_LIMIT = ("RankDependent", "expert_parallel.AllToAllEP._dispatch_tokens",
                  "expert parallelism: each rank loads only its own experts (transformers' shard_tensor gives the "
                  "others' None, core_model_loading.py:1144) and receives a routing-dependent number of tokens "
                  "(split sizes read back at expert_parallel.py:225, AllToAllEP._dispatch_tokens): per-rank lists "
                  "and shapes one process cannot hold as one value for every rank")


#: transformers' switch that loads weights in the calling thread: its default pool of loader threads runs
#: `shard_tensor` where the local world's mode is off (`core_model_loading.py`, `ThreadPoolExecutor`).
SYNC_LOAD = "HF_DEACTIVATE_ASYNC_LOAD"


@contextlib.contextmanager
def per_rank_regions():
    """Inside: weights load in the calling thread (`SYNC_LOAD`), and the functions of `PER_RANK` run per rank under
    an enabled LocalTensorMode; restored on exit."""
    import os

    from paracheck.world.regions import per_rank_functions

    before = os.environ.get(SYNC_LOAD)
    os.environ[SYNC_LOAD] = "1"
    try:
        with per_rank_functions(PER_RANK):
            yield
    finally:
        if before is None:
            del os.environ[SYNC_LOAD]
        else:
            os.environ[SYNC_LOAD] = before
