"""A TP shard's values: slicing a full parameter into one rank's shard and assembling shards back."""

from __future__ import annotations

import torch
import torch.distributed as dist

from paracheck.domain.layout import tp_shard


def full(tensor):
    """A DTensor gathered whole (differentiably); a plain tensor, or None (a pipeline stage's missing output), as is."""
    if tensor is None:
        return None
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def local_slice(full: torch.Tensor, spec, index: int, tp: int) -> torch.Tensor:
    """Shard `index` of `tp` of a planned parameter: each block of `spec.dim` is split on its own."""
    if spec.dim is None:
        return full
    return torch.cat([full.narrow(spec.dim, start, length) for start, length in tp_shard(spec.block_sizes, index, tp)],
                     dim=spec.dim)


def assemble(pieces: list[torch.Tensor], spec) -> torch.Tensor:
    """Inverse of `local_slice`: the full tensor from every TP rank's shard, in TP-coordinate order."""
    blocks, offset = [], 0
    for _, length in tp_shard(spec.block_sizes, 0, len(pieces)):  # each piece holds the same lengths
        blocks.extend(p.narrow(spec.dim, offset, length) for p in pieces)
        offset += length
    return torch.cat(blocks, dim=spec.dim)


def group_ranks(mesh, dim: str | None = None) -> list[int]:
    group = mesh.get_group(dim) if dim else mesh.get_group()
    return sorted(dist.get_process_group_ranks(group))
