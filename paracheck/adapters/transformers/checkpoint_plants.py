"""The bugs the transformers checkpoint controls plant: in the gathered save, the sharded save and the DCP load.

Each is a context manager the `checkpoint.roundtrip` pass enters around one save or load of the parallel model, so
every older check of the case ran on the model as transformers built it. They bend what transformers or torch's
DCP does there the way a release or a user's own code could: the writer handed each rank's local shards, a
pipeline stage numbering its layers from 0, a loader that ignores one dimension of the mesh. Torch-free at import
(the host reads the controls that name them).
"""

from __future__ import annotations

import contextlib


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@contextlib.contextmanager
def local_shard_save(model):
    """The gathered save writes rank 0's local shards: transformers' gather step (the model's
    `gather_sharded_state_dict_for_save`, which returns whole tensors on the writing rank) replaced by one that
    returns each DTensor's `to_local()`."""

    def gather(model_to_save, state_dict, distributed_config, *, save_on_this_rank=True):
        return {name: _local(value) for name, value in state_dict.items()} if save_on_this_rank else {}

    model.gather_sharded_state_dict_for_save = gather
    try:
        yield
    finally:
        del model.gather_sharded_state_dict_for_save


@contextlib.contextmanager
def local_layer_names(model):
    """A pipeline stage saves its layers under local names: the stage's own layers moved to the front of the
    layer list (stage 1 of 2 of a 4-layer model saves layers 2 and 3 as layers.0 and layers.1), as a stage built
    with only its own layers numbers them. The forward is not run while it holds."""
    import torch
    from transformers.distributed.pipeline_parallel import PipelineIdentityLayer

    base = getattr(model, model.base_model_prefix)
    layers = base.layers
    own = [layer for layer in layers if not isinstance(layer, PipelineIdentityLayer)]
    base.layers = torch.nn.ModuleList(own + [PipelineIdentityLayer() for _ in range(len(layers) - len(own))])
    try:
        yield
    finally:
        base.layers = layers


@contextlib.contextmanager
def skip_mesh_dim_load():
    """Every DCP load reads each DTensor of a mesh of two or more dimensions as if its first sharded mesh
    dimension were not there: the ranks along it all get the piece coordinate 0 holds. Planted on
    `torch.distributed.checkpoint.load` (which transformers' loader calls): the real load, then each such
    tensor's local shard overwritten with that piece, so shapes and keys stay right and a strict load passes."""
    import torch.distributed.checkpoint as dcp

    real = dcp.load

    def load(state_dict, *args, **kwargs):
        out = real(state_dict, *args, **kwargs)
        for value in state_dict.values():
            _first_piece(value)
        return out

    dcp.load = load
    try:
        yield
    finally:
        dcp.load = real


def _first_piece(value) -> None:
    import torch
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor) or value.device_mesh.ndim < 2:
        return
    sharded = [i for i, p in enumerate(value.placements) if p.is_shard()]
    if not sharded:
        return
    mesh, skipped = value.device_mesh, sharded[0]
    coordinate = mesh.get_coordinate()
    piece = value.full_tensor()  # a collective over the value's mesh: every rank reaches it in the same order
    for dim, placement in enumerate(value.placements):
        if placement.is_shard():
            piece = piece.chunk(mesh.size(dim), dim=placement.dim)[0 if dim == skipped else coordinate[dim]]
    local = value.to_local()
    if piece.shape == local.shape:
        with torch.no_grad():
            local.copy_(piece)


@contextlib.contextmanager
def optimizer_state_dropped():
    """The optimizer's distributed load finds none of its keys in the checkpoint and loads nothing, raising nothing:
    `torch.distributed.checkpoint.load` a no-op inside transformers' `load_optimizer_distributed`, so the resumed
    run steps on from the state a fresh optimizer is given (its moments zero). (A no-op `set_optimizer_state_dict`
    is no such bug: the DCP load writes into the optimizer's own state tensors in place; measured, it passes.)"""
    import torch.distributed.checkpoint as dcp

    real = dcp.load
    dcp.load = lambda *args, **kwargs: None
    try:
        yield
    finally:
        dcp.load = real
