"""torch-adapter layouts: `tp2xfsdp2`-style names -> the named device mesh a spec's parallelize function is handed.

Torch-free. Tokens: `pp` (pipeline parallelism: stages), `dp` (replicated data parallelism, HSDP's replicas),
`fsdp` (sharded data parallelism), `cp` (context parallelism), `tp` (tensor parallelism). A name may list them in
any order; the canonical name writes them pp, tp, cp, dp, fsdp (`tp2xfsdp2`, `pp2xtp2`, as the transformers
adapter names its layouts), and the mesh lays them out pp, dp, fsdp, cp, tp, slowest-varying first, as torchtitan
does (tp fastest, so a TP group is neighbouring ranks). The mesh has one dimension per token of degree > 1, named
by the token.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from paracheck.domain.layout import DegreeLayout, factorizations

#: Tokens in mesh order, slowest-varying first.
TOKENS = ("pp", "dp", "fsdp", "cp", "tp")
#: The order a canonical name writes them in.
NAMED = ("pp", "tp", "cp", "dp", "fsdp")
_PART = re.compile(r"^(pp|dp|fsdp|cp|tp)([0-9]+)$")


class TorchLayoutError(ValueError):
    """A torch-adapter layout name that breaks the naming rules."""


@dataclass(frozen=True)
class TorchLayout(DegreeLayout):
    pp: int = 1
    dp: int = 1
    fsdp: int = 1
    cp: int = 1
    tp: int = 1

    TOKENS = COORDS = TOKENS
    NAMED = NAMED
    PART, EXAMPLE, ERROR = _PART, "tp2xfsdp2", TorchLayoutError

    @property
    def dp_degree(self) -> int:
        """Ranks that see distinct batch shards: dp x fsdp (cp and tp ranks of one batch shard share it)."""
        return self.dp * self.fsdp

    @property
    def mesh_dims(self) -> tuple[str, ...]:
        """The mesh's dimension names, slowest-varying first: every token of degree > 1."""
        return tuple(t for t in TOKENS if getattr(self, t) > 1)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, t) for t in self.mesh_dims)

    @property
    def dp_dims(self) -> tuple[str, ...]:
        """The data-parallel mesh dimensions (what `fully_shard` is given: HSDP's (dp, fsdp), or one of them)."""
        return tuple(t for t in ("dp", "fsdp") if getattr(self, t) > 1)

    def dp_index(self, rank: int) -> int:
        """Which of the `dp_degree` batch shards `rank` sees (replica-major, then fsdp)."""
        c = self.coords(rank)
        return c["dp"] * self.fsdp + c["fsdp"]


def layouts_for(world: int) -> list[TorchLayout]:
    """Every layout of `world` ranks, one kind of parallelism first, then by name."""
    if world < 1:
        raise TorchLayoutError(f"--nproc {world}: the world size must be >= 1")
    found = [TorchLayout(*sizes) for sizes in factorizations(world, len(TOKENS))]
    found = [layout for layout in found if layout.world > 1]
    return sorted(found, key=lambda l: (len(l.kinds), l.name))


def parse_layouts(text: str, world: int) -> list[TorchLayout]:
    """`all` or a comma list of names; each must have world size `world`."""
    if text.strip() == "all":
        return layouts_for(world)
    layouts = []
    for item in text.split(","):
        layout = TorchLayout.parse(item)
        if layout.world != world:
            raise TorchLayoutError(f"--layouts {layout.name}: its world size is {layout.world} (the product of "
                                   f"{', '.join(TOKENS)}), but --nproc is {world}")
        if layout not in layouts:
            layouts.append(layout)
    return layouts
