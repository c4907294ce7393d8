"""What a rank keeps across cases, in one place with one eviction rule: the few most recently used results of a
costly step (a model source, a single-process reference, a reference's trace), so neighbouring cases that share one
compute it once, and memory stays bounded.

Every such cache is a `Recent`, and every `Recent` is registered here. The rule: each keeps its `keep` most recently
used results, the least recently used dropped before another is computed (so one never sits beside its successor);
and all of them are dropped when the rank enters another world (`enter`, asked by `meshes.for_world`, which every
case asks at its start): what one world kept never outlives it into the next, in a process that runs many worlds
(a local world, the pytest mixins, the kit's own tests).
"""

from __future__ import annotations

import weakref
from collections import Counter, OrderedDict
from typing import Callable

#: Every `Recent` alive in this process (weakly: one made for a test goes when the test drops it).
_ALL: weakref.WeakSet = weakref.WeakSet()
#: The world the caches were filled in, as `enter` last saw it (held as `meshes.for_world` holds it anyway).
_world: list = [None]


class Recent:
    """Up to `keep` results by key; the least recently used goes first. `name` says whose it is (`held`)."""

    def __init__(self, keep: int, name: str = ""):
        self.keep, self.name = keep, name
        self._kept: OrderedDict = OrderedDict()
        _ALL.add(self)

    def get(self, key, compute: Callable[[], object]):
        """The result kept for `key`, computed (and kept) the first time it is asked for."""
        if key not in self._kept:
            while len(self._kept) >= self.keep:
                self._kept.popitem(last=False)
            self._kept[key] = compute()
        self._kept.move_to_end(key)
        return self._kept[key]

    def forget(self) -> None:
        self._kept.clear()

    def __len__(self) -> int:
        return len(self._kept)


def enter(world) -> None:
    """The rank is in `world` now (any object that stands for it): entering another drops everything kept."""
    if _world[0] is not world:
        forget_all()
        _world[0] = world


def forget_all() -> None:
    for cache in list(_ALL):
        cache.forget()


def held() -> Counter:
    """name -> how many results the caches of that name hold now."""
    out: Counter = Counter()
    for cache in list(_ALL):
        out[cache.name] += len(cache)
    return out
