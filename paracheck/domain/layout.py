"""Layouts: the degree of each parallelism, and the device mesh they imply.

`Layout` owns the arithmetic from "tp2xu2" to mesh dimensions, rank coordinates and process groups.
Everything else asks it instead of recomputing strides, so the checks and the routes cannot disagree
about which rank holds which shard.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass

#: Names of the parallel dimensions, in the order layouts are written.
DIM_NAMES = ("tp", "ring", "ulysses")
ORDERS = ("cp-fastest", "tp-fastest")
_PREFIX = {"tp": "tp", "r": "ring", "u": "ulysses"}
_SHORT = {"tp": "tp", "ring": "r", "ulysses": "u"}
_PART = re.compile(r"^(tp|r|u)([0-9]+)$")


class LayoutError(ValueError):
    """A layout string or order that breaks the naming rules."""


def degree_parts(text, pattern: re.Pattern, tokens, example: str, error: type) -> list[tuple[str, int]]:
    """A layout name's parts, `tokenN` joined by 'x' (every library's grammar): [(token, degree)] in the
    order written; `error` names the part that is no `tokenN`, a token given twice, or a degree below 1."""
    if not isinstance(text, str) or not text.strip():
        raise error(f"layout '': write degrees like {example} (parts {', '.join(tokens)} joined by 'x')")
    parts: list[tuple[str, int]] = []
    for part in text.strip().lower().split("x"):
        match = pattern.match(part)
        if not match:
            raise error(f"layout {text!r}: part {part!r} is not one of {', '.join(t + 'N' for t in tokens)} "
                        f"(parts are joined by 'x', e.g. {example})")
        token, degree = match.group(1), int(match.group(2))
        if token in dict(parts):
            raise error(f"layout {text!r}: {token} appears twice")
        if degree < 1:
            raise error(f"layout {text!r}: degree of {token} must be >= 1, got {degree}")
        parts.append((token, degree))
    return parts


class _Splits:
    """What every layout answers the same way from its tp and cp degrees."""

    @property
    def has_tp(self) -> bool:
        return self.tp > 1

    @property
    def has_cp(self) -> bool:
        return self.cp > 1


class DegreeLayout(_Splits):
    """What an adapter's layout of named degrees shares (the transformers and torch grammars): each degree an
    integer >= 1, parsed from and named by its `tokenN` parts, the kinds it uses, each rank's coordinates.

    A subclass is a frozen dataclass with one int field per token in `TOKENS` and sets `NAMED` (the order a name
    writes the parts in), `COORDS` (the mesh's dimensions, slowest-varying first: the world is their product),
    `PART` (a regex of token and degree), `EXAMPLE` and `ERROR` (its layout error)."""
    TOKENS: tuple = ()
    NAMED: tuple = ()
    COORDS: tuple = ()
    PART: re.Pattern = re.compile("$^")
    EXAMPLE = ""
    ERROR: type = ValueError
    #: The kit's cases and reports read a layout's `order`; such a grammar fixes its own mesh order, so this is
    #: the kit's default name, which replay commands leave out.
    order = "cp-fastest"

    def __post_init__(self):
        for token in self.TOKENS:
            value = getattr(self, token)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise self.ERROR(f"layout degree {token}={value!r}: every degree must be an integer >= 1")

    @classmethod
    def parse(cls, text: str, order: str | None = None):
        """`tp2xfsdp2`-style names, parts in any order, each token at most once; `order` is accepted for the
        kit's `Layout.parse` signature and ignored."""
        return cls(**dict(degree_parts(text, cls.PART, cls.NAMED, cls.EXAMPLE, cls.ERROR)))

    @property
    def name(self) -> str:
        return "x".join(f"{t}{getattr(self, t)}" for t in self.NAMED if getattr(self, t) > 1) or "single"

    def __str__(self) -> str:
        return self.name

    @property
    def world(self) -> int:
        return math.prod(getattr(self, t) for t in self.COORDS)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds of parallelism this layout uses, as the kit's `Layout.kinds` (a wrong result is named by them)."""
        return tuple(t for t in self.TOKENS if getattr(self, t) > 1)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's coordinate on each of `COORDS` (row-major, as `init_device_mesh` lays them out)."""
        if not 0 <= rank < self.world:
            raise self.ERROR(f"rank {rank} is outside layout {self.name} of world size {self.world}")
        out = {}
        for token in reversed(self.COORDS):
            out[token] = rank % getattr(self, token)
            rank //= getattr(self, token)
        return {t: out[t] for t in self.COORDS}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def factorizations(n: int, parts: int):
    """Every ordered tuple of `parts` positive integers whose product is `n`."""
    if parts == 1:
        yield (n,)
        return
    for d in divisors(n):
        for rest in factorizations(n // d, parts - 1):
            yield (d,) + rest


@dataclass(frozen=True)
class Layout(_Splits):
    tp: int = 1
    ring: int = 1
    ulysses: int = 1
    order: str = "cp-fastest"

    def __post_init__(self):
        for name in DIM_NAMES:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"layout degree {name}={value!r}: every degree must be an integer >= 1")
        if self.order not in ORDERS:
            raise LayoutError(f"--order {self.order!r}: must be one of {', '.join(ORDERS)}")

    # -- naming -------------------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str, order: str = "cp-fastest") -> "Layout":
        """Parse `tp2xu2`-style names; parts in the order tp, ring, ulysses, each at most once."""
        parts = degree_parts(text, _PART, ("tp", "r", "u"), "tp2xu2", LayoutError)
        dims = [DIM_NAMES.index(_PREFIX[token]) for token, _ in parts]
        if dims != sorted(dims):
            raise LayoutError(f"layout {text!r}: parts must be written in the order tp, r, u")
        return cls(order=order, **{_PREFIX[token]: degree for token, degree in parts})

    @property
    def name(self) -> str:
        parts = [f"{_SHORT[d]}{getattr(self, d)}" for d in DIM_NAMES if getattr(self, d) > 1]
        return "x".join(parts) or "single"

    def __str__(self) -> str:
        return self.name

    # -- sizes --------------------------------------------------------------------------------
    @property
    def world(self) -> int:
        return self.tp * self.ring * self.ulysses

    @property
    def cp(self) -> int:
        return self.ring * self.ulysses

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds of parallelism this layout uses (a wrong result is named by them)."""
        return tuple(d for d in DIM_NAMES if getattr(self, d) > 1)

    @property
    def head_multiple(self) -> int:
        """Heads must be a multiple of this: TP splits heads, then Ulysses splits each rank's heads."""
        return self.tp * self.ulysses

    # -- mesh ---------------------------------------------------------------------------------
    @property
    def mesh_dims(self) -> tuple[str, ...]:
        """Mesh dimension names, slowest-varying first."""
        if self.order == "cp-fastest":
            return ("tp", "ring", "ulysses")
        return ("ring", "ulysses", "tp")

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, d) for d in self.mesh_dims)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's coordinate along each named dimension (row-major over `mesh_dims`)."""
        self._check_rank(rank)
        out: dict[str, int] = {}
        for dim, size in reversed(list(zip(self.mesh_dims, self.mesh_shape))):
            out[dim] = rank % size
            rank //= size
        return {d: out[d] for d in DIM_NAMES}

    def rank_of(self, coords: dict[str, int]) -> int:
        rank = 0
        for dim, size in zip(self.mesh_dims, self.mesh_shape):
            rank = rank * size + coords[dim]
        return rank

    def group(self, rank: int, dims: tuple[str, ...]) -> list[int]:
        """Ranks that share every coordinate of `rank` except those along `dims`, in mesh order."""
        base = self.coords(rank)
        ranges = [range(getattr(self, d)) for d in dims]
        members = []
        for values in itertools.product(*ranges):
            coords = dict(base, **dict(zip(dims, values)))
            members.append(self.rank_of(coords))
        return sorted(members)

    def groups(self, dims: tuple[str, ...]) -> list[list[int]]:
        """Every group along `dims`, each listed once."""
        seen: list[list[int]] = []
        for rank in range(self.world):
            group = self.group(rank, dims)
            if group not in seen:
                seen.append(group)
        return seen

    def tp_group(self, rank: int) -> list[int]:
        return self.group(rank, ("tp",))

    def cp_group(self, rank: int) -> list[int]:
        return self.group(rank, ("ring", "ulysses"))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world:
            raise LayoutError(f"rank {rank} is outside layout {self.name} of world size {self.world}")


def layouts_for(world: int, order: str = "cp-fastest") -> list[Layout]:
    """Every layout whose world size is `world`, single-kind ones first."""
    if world < 1:
        raise LayoutError(f"--nproc {world}: the world size must be >= 1")
    found = []
    for tp in _divisors(world):
        for ring in _divisors(world // tp):
            ulysses = world // tp // ring
            layout = Layout(tp, ring, ulysses, order)
            if layout.world > 1:
                found.append(layout)
    return sorted(found, key=lambda l: (sum(getattr(l, d) > 1 for d in DIM_NAMES), l.name))


def parse_layouts(text: str, world: int, order: str = "cp-fastest") -> list[Layout]:
    """`all` or a comma list; every layout must have world size `world`."""
    if text.strip() == "all":
        return layouts_for(world, order)
    layouts = []
    for item in text.split(","):
        layout = Layout.parse(item, order)
        if layout.world != world:
            raise LayoutError(
                f"--layouts {layout.name}: its world size is {layout.world} "
                f"({' x '.join(str(getattr(layout, d)) for d in DIM_NAMES if getattr(layout, d) > 1)}), "
                f"but --nproc is {world}; the product of the degrees must equal --nproc"
            )
        if layout not in layouts:
            layouts.append(layout)
    return layouts


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_shard(block_sizes, index: int, tp: int) -> list[tuple[int, int]]:
    """(start, length) along the sharded dim of each piece TP shard `index` of `tp` holds, in order: every
    block of a planned parameter (e.g. fused q, k, v) is split on its own. The one copy of the rule."""
    out, offset = [], 0
    for block in block_sizes:
        chunk = block // tp
        out.append((offset + index * chunk, chunk))
        offset += block
    return out


def fit_heads(heads: int, layout: Layout) -> int:
    """The smallest head count >= `heads` that tp x ulysses divides."""
    multiple = layout.head_multiple
    return -(-heads // multiple) * multiple
