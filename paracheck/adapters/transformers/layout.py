"""transformers layouts: `tp2xfsdp2`-style names <-> `DistributedConfig` sizes, and the rules transformers enforces.

Torch-free. The tokens are transformers' own dimensions: pp, tp, dpr (dp_replicate), cp, fsdp, ep. A name
may list them in any order; the canonical name writes them in that order (tp2xfsdp2, dpr2xcp2, the seed's
cp2xfsdp2). The mesh order is transformers' own and not the name's. The world is the product of the
dense sizes; `ep` is not a dense size (experts reuse the same ranks on a second mesh, `efsdp x ep`).
`cp` is offered only where the installed `DistributedConfig` has a `cp_size` field (`cp_supported`).
"""

from __future__ import annotations

import dataclasses

from paracheck.domain.layout import Grammar, Layout, divisors, factorizations

#: Tokens in the order a canonical name writes them; `ep` last, as it is not part of the dense mesh.
TOKENS = ("pp", "tp", "dpr", "cp", "fsdp", "ep")
#: The dense mesh's dimensions, slowest-varying first, as transformers lays them out.
DENSE = ("pp", "dpr", "fsdp", "cp", "tp")
#: The `DistributedConfig` field each token sets.
FIELDS = {"pp": "pp_size", "dpr": "dp_replicate_size", "fsdp": "fsdp_size", "cp": "cp_size", "tp": "tp_size",
          "ep": "ep_size"}


class TfLayoutError(ValueError):
    """A transformers layout name that breaks the naming rules."""


#: The grammar: `TfLayout(tp=2, fsdp=2)` and `TfLayout.parse("tp2xfsdp2")` make the host's `Layout`. `layout.dp`
#: is the kind dp, dp_replicate x fsdp: the ranks that see distinct batches (transformers' `dp_size`; cp ranks
#: share a batch). The mesh order is transformers' own, whatever the run's `--order`.
TfLayout = Grammar(library="transformers", dims=TOKENS, tokens=TOKENS, kind=("pp", "tp", "dp", "cp", "dp", "ep"),
                   named=TOKENS, meshes=(("cp-fastest", DENSE),), factors=("tp", "dp", "fsdp", "dpr", "ep"),
                   example="tp2xfsdp2", error=TfLayoutError)


def efsdp(layout: Layout) -> int:
    """The experts' FSDP degree: fsdp x tp / ep (transformers' `efsdp_size`)."""
    return layout.fsdp * layout.tp // layout.ep


def config_kwargs(layout: Layout) -> dict:
    """The `DistributedConfig(**kwargs)` for `layout`: every size > 1, by transformers' field name."""
    return {FIELDS[t]: getattr(layout, t) for t in TOKENS if getattr(layout, t) > 1}


def refusals(layout: Layout, moe: bool = True, cp_field: bool = False) -> list[str]:
    """What transformers refuses about `layout`, in the rule's words; empty when it would build it.
    `moe`: the model has an expert plan; `cp_field`: the installed `DistributedConfig` has `cp_size`."""
    problems = []
    if layout.cp > 1 and not cp_field:
        problems.append("cp_size: the installed transformers' DistributedConfig has no cp_size field")
    if layout.ep > 1:
        if not moe:
            problems.append(f"ep_size={layout.ep}: the model has no ep_plan")
        if layout.ep % layout.tp:
            problems.append(f"ep_size={layout.ep} must be a multiple of tp_size={layout.tp}")
        if (layout.fsdp * layout.tp) % layout.ep:
            problems.append(f"ep_size={layout.ep} must divide fsdp_size * tp_size = {layout.fsdp * layout.tp}")
    if layout.dp > 1 and layout.pp > 1:
        problems.append("combining FSDP with pipeline parallelism is not supported yet (dp_size > 1 with pp_size > 1)")
    if layout.cp > 1 and (layout.tp > 1 or layout.pp > 1 or layout.ep > 1):
        # The seed's first CP release refuses these together with cp (TP and EP come later in its stack).
        problems.append("cp_size with tp_size, pp_size or ep_size: refused together for now")
    return problems


def layouts_for(world: int, moe: bool = False, cp_field: bool = False, pp: bool = True) -> list[Layout]:
    """Every layout of `world` ranks that transformers builds for a model (with `moe`, the EP layouts too;
    without `pp`, no pipeline layouts), one kind of parallelism first."""
    if world < 1:
        raise TfLayoutError(f"--nproc {world}: the world size must be >= 1")
    dims = [t for t in DENSE if (t != "cp" or cp_field) and (t != "pp" or pp)]
    found = []
    for sizes in factorizations(world, len(dims)):
        dense = dict(zip(dims, sizes))
        for ep in (divisors(world) if moe else (1,)):
            layout = TfLayout(ep=ep, **dense)
            if layout.world > 1 and not refusals(layout, moe, cp_field):
                found.append(layout)
    return sorted(found, key=lambda l: (sum(getattr(l, t) > 1 for t in TOKENS), l.name))


def parse_layouts(text: str, world: int, moe: bool = False, cp_field: bool = False) -> list[Layout]:
    """`all` or a comma list of names; each must have world size `world`."""
    if text.strip() == "all":
        return layouts_for(world, moe, cp_field)
    layouts = []
    for item in text.split(","):
        layout = TfLayout.parse(item)
        if layout.world != world:
            raise TfLayoutError(f"--layouts {layout.name}: its world size is {layout.world} (the product of "
                                f"{', '.join(DENSE)}), but --nproc is {world}")
        if layout not in layouts:
            layouts.append(layout)
    return layouts


def cp_supported(config_class=None) -> bool:
    """Whether `DistributedConfig` (or `config_class`) has a `cp_size` field; False without transformers.
    The installed class is read from its source, so that answering imports neither transformers nor torch."""
    if config_class is not None:
        return "cp_size" in {f.name for f in dataclasses.fields(config_class)}
    return "cp_size" in _installed_config_fields()


def _installed_config_fields() -> set[str]:
    """The annotated fields of the installed `transformers.distributed.configuration_utils.DistributedConfig`."""
    import ast
    import importlib.util
    import os

    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return set()
    path = os.path.join(list(spec.submodule_search_locations)[0], "distributed", "configuration_utils.py")
    try:
        with open(path) as handle:
            tree = ast.parse(handle.read())
    except (OSError, SyntaxError):
        return set()
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DistributedConfig"]
    return {n.target.id for c in classes for n in c.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


#: The dimensions that split parameters: a layout that differs from another in none of them loads a checkpoint
#: into the same shards (dp_replicate only copies them).
SHARDING = ("pp", "fsdp", "tp", "ep")


def reload_layout(layout: Layout, world: int, moe: bool = False, cp_field: bool = False,
                  rows: int = 0, fits=lambda other: True) -> Layout | None:
    """The layout `checkpoint.roundtrip` loads `layout`'s checkpoint into: another layout of `world` ranks that
    transformers builds for the model, splitting parameters differently in as many of `SHARDING` as it can (then
    sharding over more of them, then by name), so every dimension's shards are re-cut. A pipeline layout goes to
    another pipeline size where one builds, else to none (pp1); any other layout stays without pipeline stages (a
    stage returns no loss to resume training with). `rows`: the global batch's rows, which the new layout's
    data-parallel degree must divide (0: any). `fits(other)`: whether the model's sizes take it (the fitting rule on
    the model's config: a user's tiny config may not split by 4). None where no other layout fits."""
    candidates = [other for other in layouts_for(world, moe, cp_field)
                  if other != layout and other.dp and (not rows or rows % other.dp == 0) and fits(other)
                  and any(getattr(other, t) != getattr(layout, t) for t in SHARDING)
                  # pp with tp raises while loading (declared: docs/upstream/transformers_pp_tp_keyerror.md)
                  and not (other.pp > 1 and other.tp > 1) and (other.pp == 1 or layout.pp > 1)]
    staged = [other for other in candidates if other.pp > 1]
    pool = staged if layout.pp > 1 and staged else [other for other in candidates if other.pp == 1]
    if not pool:
        return None
    return min(pool, key=lambda other: (-sum(getattr(other, t) != getattr(layout, t) for t in SHARDING),
                                        -sum(getattr(other, t) > 1 for t in SHARDING), other.name))
