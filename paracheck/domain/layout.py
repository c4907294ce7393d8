"""Layouts: the degree of each parallel dimension, by name, and the device mesh they imply (one host concept).

A `Layout` is what every adapter's layout name parses into, in the manner of torchtitan's `ParallelDims`: ordered
(dimension, degree) pairs, validated once; the mesh's dimension names and shape in order; each rank's coordinates
and the ranks of a group along any dimensions. Each adapter declares its grammar (`Grammar`: its dimensions, how a
name spells them, the mesh order, the kind of parallelism each dimension is) and parses its names with it; the host
asks the layout only questions in those terms (a degree by name, the product of a kind's dimensions, a group), so it
never names one library's dimensions. The arithmetic lives here once, so the checks and the routes cannot disagree
about which rank holds which shard.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass

#: The mesh orders a run may ask for (`--order`); a grammar of one mesh order has no choice to make.
ORDERS = ("cp-fastest", "tp-fastest")


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


@dataclass(frozen=True)
class Grammar:
    """An adapter's layout grammar: its dimensions and how names, meshes and kinds read them. Calling it makes a
    `Layout` (degrees positionally in `dims` order or by name, a trailing string the order); `parse` reads a name.

    `dims`: the dimensions, in the order `kinds` lists them. `tokens`: how a name spells each (same order).
    `kind`: the kind of parallelism each is ("tp", "cp", "dp", ...), which the host asks by (`size`, `dims_of`).
    `named`: the order a canonical name writes them in. `meshes`: (order, mesh dimensions slowest-varying first)
    for each mesh order the grammar offers, its default first; a dimension in no mesh (transformers' `ep`) is not
    part of the world. `drop_unit`: the mesh leaves out dimensions of degree 1. `ordered`: a name must write its
    parts in `named` order. `factors`: the degrees (dimensions or kinds) a wrong gradient's factor may be named
    after, in the order the localization lists them. `example`, `error`: what a refusal shows and raises."""
    library: str
    dims: tuple[str, ...]
    tokens: tuple[str, ...]
    kind: tuple[str, ...]
    named: tuple[str, ...]
    meshes: tuple[tuple[str, tuple[str, ...]], ...]
    factors: tuple[str, ...]
    example: str
    error: type = LayoutError
    drop_unit: bool = False
    ordered: bool = False

    def __call__(self, *degrees, **named) -> "Layout":
        order = named.pop("order", None)
        if degrees and isinstance(degrees[-1], str):
            degrees, order = degrees[:-1], degrees[-1]
        if len(degrees) > len(self.dims) or set(named) - set(self.dims):
            raise TypeError(f"a {self.library} layout has dimensions {', '.join(self.dims)}")
        values = dict(zip(self.dims, degrees), **named)
        return Layout(self, tuple(values.get(d, 1) for d in self.dims), self.mesh_order(order))

    def parse(self, text: str, order: str | None = None) -> "Layout":
        """A `tp2x...`-style name in this grammar; `order` picks the mesh order where the grammar offers several."""
        by_token = dict(zip(self.tokens, self.dims))
        written = [self.tokens[self.dims.index(d)] for d in self.named]
        pattern = re.compile(rf"^({'|'.join(written)})([0-9]+)$")
        parts = degree_parts(text, pattern, written, self.example, self.error)
        if self.ordered:
            places = [self.named.index(by_token[token]) for token, _ in parts]
            if places != sorted(places):
                raise self.error(f"layout {text!r}: parts must be written in the order {', '.join(written)}")
        return self(order=order, **{by_token[token]: degree for token, degree in parts})

    def mesh_order(self, order: str | None) -> str:
        """The mesh order `order` names in this grammar (its default for None)."""
        orders = [o for o, _ in self.meshes]
        if order is None or len(orders) == 1:
            return orders[0]  # a grammar of one mesh order fixes it (the kit's default name for it)
        if order not in orders:
            raise self.error(f"--order {order!r}: must be one of {', '.join(orders)}")
        return order

    def layouts_for(self, world: int) -> list["Layout"]:
        """Every layout of `world` ranks over the mesh's dimensions (the others of degree 1), one kind first."""
        if world < 1:
            raise self.error(f"--nproc {world}: the world size must be >= 1")
        mesh = self.meshes[0][1]
        found = [self(**dict(zip(mesh, sizes))) for sizes in factorizations(world, len(mesh))]
        return sorted((l for l in found if l.world > 1), key=lambda l: (len(l.kinds), l.name))


@dataclass(frozen=True)
class Layout:
    """One layout: `grammar`'s degrees (in its `dims` order) and the mesh order. Ask it by name: `layout.tp`
    is the degree of dimension `tp`, or, where no dimension has that name, the product of the degrees of every
    dimension of kind `tp` (diffusers' `cp` is ring x ulysses; transformers' `dp` is dp_replicate x fsdp)."""
    grammar: Grammar
    sizes: tuple[int, ...]
    order: str

    def __post_init__(self):
        for dim, value in zip(self.grammar.dims, self.sizes):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise self.grammar.error(f"layout degree {dim}={value!r}: every degree must be an integer >= 1")

    def __getattr__(self, name: str) -> int:
        grammar = self.__dict__.get("grammar")
        if grammar is None or name.startswith("_"):
            raise AttributeError(name)
        if name in grammar.dims:
            return self.sizes[grammar.dims.index(name)]
        if name in grammar.kind:
            return self.size(name)
        raise AttributeError(f"a {grammar.library} layout has no dimension or kind {name!r}")

    def __repr__(self) -> str:
        return f"Layout({self.grammar.library} {self.name}, {self.order})"

    # -- naming -------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        g = self.grammar
        parts = [f"{g.tokens[g.dims.index(d)]}{self.degree(d)}" for d in g.named if self.degree(d) > 1]
        return "x".join(parts) or "single"

    def __str__(self) -> str:
        return self.name

    @property
    def library(self) -> str:
        return self.grammar.library

    # -- degrees ------------------------------------------------------------------------------
    @property
    def degrees(self) -> dict[str, int]:
        """Every dimension's degree, by name, in the grammar's order."""
        return dict(zip(self.grammar.dims, self.sizes))

    def degree(self, dim: str) -> int:
        return self.sizes[self.grammar.dims.index(dim)]

    def dims_of(self, kind: str) -> tuple[str, ...]:
        """The dimensions of kind `kind`, in the grammar's order."""
        return tuple(d for d, k in zip(self.grammar.dims, self.grammar.kind) if k == kind)

    def size(self, kind: str) -> int:
        """The product of the degrees of every dimension of kind `kind` (1 where there is none)."""
        return math.prod(self.degree(d) for d in self.dims_of(kind))

    @property
    def has_tp(self) -> bool:
        return self.size("tp") > 1

    @property
    def has_cp(self) -> bool:
        return self.size("cp") > 1

    @property
    def world(self) -> int:
        return math.prod(self.degree(d) for d in self._mesh)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The dimensions this layout splits over (degree > 1), in the grammar's order: a wrong result is named
        by them."""
        return tuple(d for d in self.grammar.dims if self.degree(d) > 1)

    def factor_degrees(self) -> dict[str, int]:
        """The degrees a wrong gradient's factor may be named after (the grammar's `factors`), and the world."""
        return dict({name: getattr(self, name) for name in self.grammar.factors}, world=self.world)

    # -- mesh ---------------------------------------------------------------------------------
    @property
    def _mesh(self) -> tuple[str, ...]:
        return dict(self.grammar.meshes)[self.order]

    @property
    def mesh_dims(self) -> tuple[str, ...]:
        """Mesh dimension names, slowest-varying first (those of degree 1 left out where the grammar drops them)."""
        if self.grammar.drop_unit:
            return tuple(d for d in self._mesh if self.degree(d) > 1)
        return self._mesh

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.degree(d) for d in self.mesh_dims)

    def with_order(self, order: str | None) -> "Layout":
        """This layout's degrees laid out in mesh order `order` (its own when None)."""
        return Layout(self.grammar, self.sizes, self.grammar.mesh_order(order or self.order))

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's coordinate along each mesh dimension (row-major over the mesh, as `init_device_mesh` lays
        it out), in the grammar's order."""
        if not 0 <= rank < self.world:
            raise self.grammar.error(f"rank {rank} is outside layout {self.name} of world size {self.world}")
        out: dict[str, int] = {}
        for dim in reversed(self._mesh):
            out[dim] = rank % self.degree(dim)
            rank //= self.degree(dim)
        return {d: out[d] for d in self.grammar.dims if d in out}

    def rank_of(self, coords: dict[str, int]) -> int:
        rank = 0
        for dim in self._mesh:
            rank = rank * self.degree(dim) + coords[dim]
        return rank

    def index(self, rank: int, kind: str) -> int:
        """Which of the `size(kind)` shards of kind `kind` `rank` holds (row-major over those dimensions in mesh
        order: the data-parallel batch shard of `dp`)."""
        coords, index = self.coords(rank), 0
        for dim in (d for d in self._mesh if d in self.dims_of(kind)):
            index = index * self.degree(dim) + coords[dim]
        return index

    @property
    def dp_degree(self) -> int:
        """Ranks that see distinct batch shards: the product of the data-parallel (`dp` kind) degrees."""
        return self.size("dp")

    @property
    def dp_dims(self) -> tuple[str, ...]:
        """The data-parallel mesh dimensions of degree > 1 (what `fully_shard` is given: HSDP's (dp, fsdp))."""
        return tuple(d for d in self.mesh_dims if d in self.dims_of("dp") and self.degree(d) > 1)

    def dp_index(self, rank: int) -> int:
        """Which of the `dp_degree` batch shards `rank` sees (replica-major, then fsdp)."""
        return self.index(rank, "dp")

    def group(self, rank: int, dims: tuple[str, ...]) -> list[int]:
        """Ranks that share every coordinate of `rank` except those along `dims`, in rank order. A dimension of
        degree > 1 that is not on this mesh (transformers' `ep`, on the expert mesh) has no group here: ValueError."""
        off = [d for d in dims if d not in self._mesh and self.degree(d) > 1]
        if off:
            raise ValueError(f"layout {self.name}: {', '.join(off)} is not a dimension of its mesh "
                             f"({', '.join(self._mesh)}), so it has no group there")
        base = self.coords(rank)
        members = []
        for values in itertools.product(*(range(self.degree(d)) for d in dims)):
            members.append(self.rank_of(dict(base, **dict(zip(dims, values)))))
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
        return self.group(rank, self.dims_of("tp"))

    def cp_group(self, rank: int) -> list[int]:
        return self.group(rank, self.dims_of("cp"))


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


def tp_shard(block_sizes, index: int, tp: int) -> list[tuple[int, int]]:
    """(start, length) along the sharded dim of each piece TP shard `index` of `tp` holds, in order: every
    block of a planned parameter (e.g. fused q, k, v) is split on its own. The one copy of the rule."""
    out, offset = [], 0
    for block in block_sizes:
        chunk = block // tp
        out.append((offset + index * chunk, chunk))
        offset += block
    return out
