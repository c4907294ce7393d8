"""A torch spec's batch and a module's outputs: calling a module on a batch, moving it to a device, one
data-parallel rank's shard of it, and DTensors in an output gathered whole (the case's passes and parity.steps')."""

from __future__ import annotations

import torch

from paracheck.checks import shards


def call(model, batch):
    return model(**batch) if isinstance(batch, dict) else model(batch)


def to(batch, device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def shard(value, index: int, degree: int):
    """Shard `index` of `degree` equal shards on dim 0 of every tensor in `value` (nested tuples and dicts)."""
    if degree == 1:
        return value
    if isinstance(value, torch.Tensor):
        return value.chunk(degree, dim=0)[index] if value.dim() >= 1 else value
    if isinstance(value, dict):
        return {k: shard(v, index, degree) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(shard(v, index, degree) for v in value)
    return value


def full(value):
    """DTensors gathered whole (differentiably), anywhere in nested tuples and dicts."""
    return each_tensor(value, shards.full)


def each_tensor(value, fn):
    """`value` with `fn` applied to every tensor in it, anywhere in nested tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: each_tensor(v, fn) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(each_tensor(v, fn) for v in value)
    return value
