"""Backends: which collectives a platform has, which layouts it can run, and the CPU shims for gloo.

The topology rules are pure (no process group), so `paracheck topology` and the tests can ask them
anywhere. The shims are the only place paracheck bends diffusers, and each is scoped to a `with` block.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from .layout import Layout

BACKENDS = ("gloo", "nccl", "neuron")

# Neuron's all-to-all accepts only contiguous replica groups of these sizes (or multiples of 32).
_NEURON_ALLTOALL_SIZES = (4, 8, 16)

RING_NEEDS_LSE = (
    "ring attention needs the attention log-sum-exp, and diffusers' native attention backend "
    "(the only one that runs on CPU) does not return it, so gloo has no ring backend"
)


@dataclass(frozen=True)
class Backend:
    name: str
    dist_backend: str
    device_type: str

    def problems(self, layout: Layout) -> list[str]:
        """Why this backend cannot run `layout`; empty when it can."""
        found = []
        if self.name == "gloo" and layout.ring > 1:
            found.append(RING_NEEDS_LSE)
        if self.name == "neuron" and layout.ulysses > 1:
            u = layout.ulysses
            if u not in _NEURON_ALLTOALL_SIZES and u % 32 != 0:
                found.append(
                    f"ulysses degree {u}: Neuron's all-to-all takes groups of 4, 8, 16 or a multiple of 32"
                )
            if layout.has_tp and layout.order == "tp-fastest":
                found.append(
                    "--order tp-fastest makes Ulysses groups strided, and Neuron's all-to-all only accepts "
                    "contiguous replica groups; use --order cp-fastest"
                )
        return found

    def device_for(self, local_rank: int) -> str:
        if self.device_type == "cpu":
            return "cpu"
        return f"{self.device_type}:{local_rank}"


_TABLE = {
    "gloo": Backend("gloo", "gloo", "cpu"),
    "nccl": Backend("nccl", "nccl", "cuda"),
    "neuron": Backend("neuron", "neuron", "neuron"),
}


class BackendError(ValueError):
    """An unknown backend, or one this machine cannot run."""


def get_backend(name: str) -> Backend:
    if name not in _TABLE:
        raise BackendError(f"--backend {name!r}: must be one of auto, {', '.join(BACKENDS)}")
    return _TABLE[name]


def resolve(name: str) -> Backend:
    """`auto` is nccl where CUDA devices are visible, neuron where Neuron cores are, else gloo."""
    if name != "auto":
        return get_backend(name)
    if _cuda_count() > 0:
        return _TABLE["nccl"]
    if os.environ.get("NEURON_RT_VISIBLE_CORES") or os.path.exists("/dev/neuron0"):
        return _TABLE["neuron"]
    return _TABLE["gloo"]


def device_limit(backend: Backend) -> int | None:
    """How many ranks the backend can place on this machine; None when unbounded (gloo)."""
    if backend.name == "nccl":
        return _cuda_count()
    return None


def _cuda_count() -> int:
    # Read the environment first so the launcher need not import torch just to pick a backend.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


# --------------------------------------------------------------------------------------------
# gloo shims. diffusers 0.42 assumes an accelerator in exactly two places; on CPU both refuse
# before any parallel code runs. Each shim lifts one refusal, only inside a `with` block.
# tests/test_shims.py fails if diffusers changes under them.
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def cpu_device_count():
    """`ModelMixin._resolve_parallel_config` picks `rank % torch.accelerator.device_count()`, a modulo
    by zero on CPU. Inside this block the count reads 1 when no accelerator exists, so the device is `cpu:0`."""
    import torch

    original = torch.accelerator.device_count
    if original() > 0:
        yield
        return
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = original


@contextlib.contextmanager
def cpu_tensor_parallel():
    """`apply_tensor_parallel` allows only accelerator device types; torch's DTensor runs on CPU meshes
    too, so inside this block `cpu` joins the allowlist."""
    import diffusers.hooks.tensor_parallel as tp

    original = tp._SUPPORTED_TP_DEVICES
    tp._SUPPORTED_TP_DEVICES = tuple(original) + ("cpu",)
    try:
        yield
    finally:
        tp._SUPPORTED_TP_DEVICES = original


@contextlib.contextmanager
def shims(backend: Backend):
    """The shims a backend needs around the library's parallel entry points; none off gloo."""
    if backend.name != "gloo":
        yield
        return
    with cpu_device_count(), cpu_tensor_parallel():
        yield
