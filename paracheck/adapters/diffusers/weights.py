"""A model holding given weights, built without drawing random weights only to overwrite them."""

from __future__ import annotations

import contextlib

import torch


#: torch.nn.init's random initializers. A module's __init__ draws its weights with them; a copy of a model
#: whose weights we hold has them overwritten in full right after, so it need not draw them first.
_RANDOM_INITS = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                 "xavier_normal_", "orthogonal_", "sparse_")


def copy_of(model_class: type, init_dict: dict, state: dict, device: torch.device, dtype: torch.dtype):
    """`model_class(**init_dict)` in eval mode on `device` in `dtype`, holding `state` (load_state_dict is
    strict: every parameter and persistent buffer comes from `state`). The same model as constructing
    and loading gives, without drawing random weights only to overwrite them: buffers outside the state
    (rotary tables) are computed in __init__ as always, and deterministic initializers still run."""
    with _undrawn():
        model = model_class(**init_dict).eval()
    if not _placed(model, device, dtype):
        model = model.to(device, dtype)
    model.load_state_dict(state)
    return model


def _placed(model, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `model.to(device, dtype)` would change nothing: it casts floating and complex tensors
    only. Skipping it spares a walk over every module and diffusers' warning about fp32 modules."""
    return all(t.device == device and (t.dtype == dtype or not (t.is_floating_point() or t.is_complex()))
               for t in (*model.parameters(), *model.buffers()))


@contextlib.contextmanager
def _undrawn():
    """Inside: torch.nn.init's random initializers leave their tensor as it is; restored on exit, also on error."""
    from torch.nn import init

    saved = {name: getattr(init, name) for name in _RANDOM_INITS if hasattr(init, name)}
    for name in saved:
        setattr(init, name, _unchanged)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(init, name, fn)


def _unchanged(tensor, *args, **kwargs):
    return tensor
