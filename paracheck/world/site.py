"""Where a rank runs one case: what the generic rank loop hands an adapter's entry point."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class CaseSite:
    """The case's index in the run, its own working folder, where references live, and which reference
    keys this rank computes (the others wait for the owner's file)."""
    index: int
    workdir: str
    refs_dir: str
    computes: Callable[[str], bool]


class Owners:
    """Which rank computes each reference: keys dealt out round-robin in the order cases need them
    (every rank sees the same order, so they agree without talking)."""

    def __init__(self, world: int):
        self.world, self._order = world, {}

    def owner(self, key: str) -> int:
        self._order.setdefault(key, len(self._order))
        return self._order[key] % self.world


def local_device(backend) -> torch.device:
    return torch.device(backend.device_for(int(os.environ.get("LOCAL_RANK", 0))))
