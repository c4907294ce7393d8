"""Backends: which collectives a platform has, which layouts it can run, and where its ranks live.

Pure and torch-free (no process group), so `paracheck topology` and usage errors answer anywhere.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

BACKENDS = ("gloo", "nccl", "neuron")

#: Neuron's all-to-all accepts only contiguous replica groups of these sizes (or multiples of 32).
NEURON_ALLTOALL_SIZES = (4, 8, 16)


def neuron_alltoall_takes(size: int) -> bool:
    """Whether Neuron's all-to-all takes a replica group of `size` ranks (the one copy of the rule)."""
    return size in NEURON_ALLTOALL_SIZES or size % 32 == 0


@dataclass(frozen=True)
class Backend:
    name: str
    dist_backend: str
    device_type: str

    def group_problems(self, alltoall_ranks: list[int]) -> list[str]:
        """Why this backend cannot run an all-to-all over the process group `alltoall_ranks` (ranks in
        group order); empty when it can."""
        if self.name != "neuron":
            return []
        problems, size = [], len(alltoall_ranks)
        if not neuron_alltoall_takes(size):
            problems.append(f"all-to-all group of {size} ranks: Neuron takes 4, 8, 16 or a multiple of 32")
        if list(alltoall_ranks) != list(range(alltoall_ranks[0], alltoall_ranks[0] + size)):
            problems.append(f"all-to-all group {list(alltoall_ranks)} is strided: Neuron takes contiguous replica "
                            "groups only")
        return problems

    def device_for(self, local_rank: int) -> str:
        if self.device_type == "cpu":
            return "cpu"
        return f"{self.device_type}:{local_rank}"


_TABLE = {
    # gloo's groups are made as "cpu:gloo", the device they serve named in the backend string: libraries read that
    # string to choose where a collective's tensors live. diffusers' `gather_size_by_comm` gathers on the CPU only
    # when the string says "cpu", else on `torch.accelerator.current_accelerator()`, which a CUDA build of torch
    # names even with no GPU ("Cannot re-initialize CUDA in forked subprocess" in the uneven cases). Plain
    # "gloo" groups (torch's own default) gather on CUDA there; the string is what every subgroup inherits.
    "gloo": Backend("gloo", "cpu:gloo", "cpu"),
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
    if backend.name == "neuron":
        return _neuron_count()
    return None


def missing_devices(backend: Backend, nproc: int) -> str | None:
    """Why this machine cannot place `nproc` ranks on `backend`; None when it can."""
    limit = device_limit(backend)
    if limit is None or nproc <= limit:
        return None
    if backend.name == "neuron" and limit == 0:
        return (f"--backend neuron: no Neuron device here (no /dev/neuron*, NEURON_RT_VISIBLE_CORES unset); "
                f"--nproc {nproc} needs {nproc} NeuronCores")
    return f"--nproc {nproc}: backend {backend.name} sees only {limit} devices here"


def _neuron_count() -> int | None:
    cores = os.environ.get("NEURON_RT_VISIBLE_CORES")
    if cores:
        count = 0
        for part in cores.split(","):
            low, _, high = part.strip().partition("-")
            count += int(high) - int(low) + 1 if high else 1
        return count
    # Device nodes without the variable: cores per device vary by generation, so do not bound.
    return None if glob.glob("/dev/neuron[0-9]*") else 0


def _cuda_count() -> int:
    # Read the environment first so the launcher need not import torch just to pick a backend.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    if not glob.glob("/dev/nvidia[0-9]*"):
        return 0  # no driver device nodes: no CUDA device, and no torch import to learn it
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0
