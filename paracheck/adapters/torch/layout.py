"""torch-adapter layouts: `tp2xfsdp2`-style names -> the named device mesh a spec's parallelize function is handed.

Torch-free. Tokens: `pp` (pipeline parallelism: stages), `dp` (replicated data parallelism, HSDP's replicas),
`fsdp` (sharded data parallelism), `cp` (context parallelism), `tp` (tensor parallelism). A name may list them in
any order; the canonical name writes them pp, tp, cp, dp, fsdp (`tp2xfsdp2`, `pp2xtp2`, as the transformers
adapter names its layouts), and the mesh lays them out pp, dp, fsdp, cp, tp, slowest-varying first, as torchtitan
does (tp fastest, so a TP group is neighbouring ranks). The mesh has one dimension per token of degree > 1, named
by the token.
"""

from __future__ import annotations

from paracheck.domain.layout import Grammar, Layout

#: Tokens in mesh order, slowest-varying first.
TOKENS = ("pp", "dp", "fsdp", "cp", "tp")
#: The order a canonical name writes them in.
NAMED = ("pp", "tp", "cp", "dp", "fsdp")


class TorchLayoutError(ValueError):
    """A torch-adapter layout name that breaks the naming rules."""


#: The grammar: `TorchLayout(tp=2, fsdp=2)` and `TorchLayout.parse("tp2xfsdp2")` make the host's `Layout`; its mesh
#: leaves out the dimensions of degree 1. `layout.dp_degree` is dp x fsdp, the ranks that see distinct batch shards
#: (cp and tp ranks of one batch shard share it); `layout.dp_index(rank)` is which one `rank` sees.
TorchLayout = Grammar(library="torch", dims=TOKENS, tokens=TOKENS, kind=("pp", "dp", "dp", "cp", "tp"), named=NAMED,
                      meshes=(("cp-fastest", TOKENS),), factors=("tp", "pp", "dp", "fsdp", "cp"),
                      example="tp2xfsdp2", error=TorchLayoutError, drop_unit=True)


def layouts_for(world: int) -> list[Layout]:
    """Every layout of `world` ranks, one kind of parallelism first, then by name."""
    return TorchLayout.layouts_for(world)


def parse_layouts(text: str, world: int) -> list[Layout]:
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
