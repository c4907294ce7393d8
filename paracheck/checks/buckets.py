"""One collective for many tensors: flatten them per dtype, gather or reduce once, and split them back."""

from __future__ import annotations

import math
from typing import Callable

import torch


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One new 1-D buffer holding `tensors` (one dtype) back to back."""
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten(flat: torch.Tensor, shapes: list) -> list[torch.Tensor]:
    """Inverse of `flatten`: views of `flat` in `shapes`."""
    sizes = [math.prod(shape) for shape in shapes]
    return [piece.view(shape) for piece, shape in zip(flat.split(sizes), shapes)]


def dtype_buckets(tensors: dict) -> list[list[str]]:
    """The names grouped by dtype (a buffer has one), buckets in an order every rank agrees on."""
    buckets: dict[str, list[str]] = {}
    for name, tensor in tensors.items():
        buckets.setdefault(str(tensor.dtype), []).append(name)
    return [buckets[key] for key in sorted(buckets)]


def gather_each(tensors: dict, all_gather: Callable) -> dict:
    """name -> every rank's copy of that tensor, from one `all_gather(flat) -> [flat per rank]` per dtype."""
    out = {}
    for names in dtype_buckets(tensors):
        shapes = [tensors[n].shape for n in names]
        per_rank = [unflatten(flat, shapes) for flat in all_gather(flatten([tensors[n] for n in names]))]
        out.update({name: [pieces[i] for pieces in per_rank] for i, name in enumerate(names)})
    return out


def reduce_each(tensors: dict, all_reduce: Callable) -> dict:
    """name -> that tensor reduced over the group, from one in-place `all_reduce(flat)` per dtype (as
    torch's own coalesced all-reduce does); the inputs are left as they were."""
    out = {}
    for names in dtype_buckets(tensors):
        flat = flatten([tensors[n] for n in names])
        all_reduce(flat)
        out.update(zip(names, unflatten(flat, [tensors[n].shape for n in names])))
    return out
