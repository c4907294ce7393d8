"""`--shard I/N`: the I-th of N deterministic slices of a run's cases, for splitting one run across CI jobs.

Pure and torch-free. Cases that share a group key (a model: one checkpoint, one reference) stay in one slice;
groups are dealt largest first to the slice holding the fewest cases so far (ties to the lowest slice), so the
slices are balanced, disjoint, cover every case, and depend only on the case list.
"""

from __future__ import annotations

import re
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")
_SHARD = re.compile(r"^([0-9]+)/([0-9]+)$")


class ShardError(ValueError):
    """A `--shard` value that breaks the I/N rule."""


def parse_shard(text: str) -> tuple[int, int]:
    """`"2/5"` -> (2, 5); I counts from 1 and 1 <= I <= N."""
    match = _SHARD.match(text.strip())
    if not match:
        raise ShardError(f"--shard {text!r}: write I/N, the I-th of N slices (1 <= I <= N), e.g. 1/4")
    index, count = int(match.group(1)), int(match.group(2))
    if not 1 <= index <= count:
        raise ShardError(f"--shard {text!r}: I must be between 1 and N={count}")
    return index, count


def slices(items: Sequence[T], count: int, group: Callable[[T], object] = id) -> list[list[int]]:
    """The indices of `items` in each of `count` slices, each slice in the items' order."""
    groups: dict[object, list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(group(item) if group is not id else i, []).append(i)
    loads, out = [0] * count, [[] for _ in range(count)]
    for members in sorted(groups.values(), key=lambda m: (-len(m), m[0])):
        target = min(range(count), key=lambda s: (loads[s], s))
        loads[target] += len(members)
        out[target] += members
    return [sorted(s) for s in out]


def shard(items: Sequence[T], index: int, count: int, group: Callable[[T], object] = id) -> list[T]:
    """The items of slice `index` (1-based) of `count`, in their order."""
    return [items[i] for i in slices(items, count, group)[index - 1]]
