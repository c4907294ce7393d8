"""What a rank keeps across cases: the few most recently used results of a costly step (a model source, a
single-process reference), so neighbouring cases that share one compute it once, and memory stays bounded."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable


class Recent:
    """Up to `keep` results by key; the least recently used goes first."""

    def __init__(self, keep: int):
        self.keep = keep
        self._kept: OrderedDict = OrderedDict()

    def get(self, key, compute: Callable[[], object]):
        """The result kept for `key`, computed (and kept) the first time it is asked for."""
        if key not in self._kept:
            self._kept[key] = compute()
            if len(self._kept) > self.keep:
                self._kept.popitem(last=False)
        self._kept.move_to_end(key)
        return self._kept[key]
