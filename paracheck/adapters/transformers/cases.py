"""The transformers cases `paracheck run` asks for: a fixture's layouts, variants and controls, as kit `Case`s.

Torch-free. Layouts are read with the transformers grammar (`layout`); with `all`, every layout of the world
that transformers builds for the fixture (EP layouts for the MoE, CP ones where `DistributedConfig` has
`cp_size`). A layout transformers refuses for a model it names (e.g. ep on a dense model) runs as a skip,
in transformers' words.
"""

from __future__ import annotations

from paracheck.domain.case import Case
from paracheck.domain.records import Route
from paracheck.adapters.transformers import LIBRARY
from paracheck.adapters.transformers.controls import CONTROLS
from paracheck.adapters.transformers.fixtures import FIXTURES, MOE, VARIANTS
from paracheck.adapters.transformers.layout import cp_supported, layouts_for, parse_layouts

FACTORY_PREFIX = "paracheck.adapters.transformers.fixtures:"


def factory_of(name: str) -> str:
    return FACTORY_PREFIX + name


def layouts(model: str, text: str, world: int) -> list:
    cp = cp_supported()
    return layouts_for(world, model in MOE, cp) if text.strip() == "all" else parse_layouts(text, world, model in MOE, cp)


def expand(model: str, layouts_text: str, world: int, variants, controls: bool = False,
           only_control: str | None = None, grads: bool = True) -> list[Case]:
    """Per layout and variant: the plain case (unless `only_control`), then each control (every one with
    `controls`; those that cannot apply on a layout run as skips naming why)."""
    if model not in FIXTURES:
        raise ValueError(f"--models {model}: transformers fixtures are {', '.join(FIXTURES)}")
    names = [only_control] if only_control else (list(CONTROLS) if controls else [])
    cases = []
    for layout in layouts(model, layouts_text, world):
        for variant in [v for v in VARIANTS if v in variants]:
            fields = dict(layout=layout, route=Route.SHARDED_LOAD, variant=variant, library=LIBRARY, grads=grads)
            if not only_control:
                cases.append(Case(model, factory_of(model), **fields))
            cases += [Case(model, factory_of(model), **dict(fields, control=c, grads=True)) for c in names
                      if c in CONTROLS]
    return cases
