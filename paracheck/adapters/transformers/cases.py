"""The transformers cases `paracheck run` asks for and `paracheck explore` draws: a fixture's layouts, variants,
controls and input shapes, as kit `Case`s.

Torch-free. Layouts are read with the transformers grammar (`layout`); with `all`, every layout of the world
that transformers builds for the fixture (EP layouts for the MoE, CP ones where `DistributedConfig` has
`cp_size`). A layout transformers refuses for a model it names (e.g. ep on a dense model) runs as a skip,
in transformers' words. A case's factory is a fixture's (`fixtures.llama`, ...) or a `--spec` one with
`library = "transformers"`: `(variant, shape) -> (fixture name, Shape or None)`, called by the launcher and by
every rank (so a spec may bend the rank's process, as a diffusers spec's factory can).
"""

from __future__ import annotations

import dataclasses
import inspect

from paracheck.domain.case import Case, SpecError, load_factory
from paracheck.domain.records import Route
from paracheck.domain.shapes import THIRD, Shape, Space
from paracheck.adapters.transformers import LIBRARY
from paracheck.adapters.transformers.controls import CONTROLS
from paracheck.adapters.transformers.fixtures import FIXTURES, MOE, SPACE, TOKENS, VARIANTS
from paracheck.adapters.transformers.layout import cp_supported, layouts_for, parse_layouts, refusals

FACTORY_PREFIX = "paracheck.adapters.transformers.fixtures:"


def factory_of(name: str) -> str:
    return FACTORY_PREFIX + name


def layouts(model: str, text: str, world: int) -> list:
    cp = cp_supported()
    return layouts_for(world, model in MOE, cp) if text.strip() == "all" else parse_layouts(text, world, model in MOE, cp)


def expand(model: str, layouts_text: str, world: int, variants, controls: bool = False,
           only_control: str | None = None, grads: bool = True, factory: str | None = None,
           dtype: str = "fp32") -> list[Case]:
    """Per layout and variant: the plain case (unless `only_control`), then each control (every one with
    `controls`; those that cannot apply on a layout run as skips naming why). `factory`: a transformers
    `--spec` (model is then its name; its fixture, its `variants` and its shape come from it)."""
    fixture, offered = model, VARIANTS
    if factory is not None:
        fixture, _ = spec_inputs(factory)
        offered = tuple(getattr(load_factory(factory), "variants", ("base",)))
    elif model not in FIXTURES:
        raise ValueError(f"--models {model}: transformers fixtures are {', '.join(FIXTURES)}")
    names = [c for c in ([only_control] if only_control else (list(CONTROLS) if controls else [])) if c in CONTROLS]
    return cases_on(model, factory or factory_of(model), layouts(fixture, layouts_text, world),
                    [v for v in offered if v in variants], lambda layout: names, plain=not only_control, grads=grads,
                    dtype=dtype)


def cases_on(model: str, factory: str, layouts, variants, controls, plain: bool = True, **fields) -> list[Case]:
    """The one expansion, for run, explore's replays and the mixin: per layout and variant, the plain case (unless
    `plain` is off), then one per control name `controls(layout)` gives (controls always run gradients)."""
    cases = []
    for layout in layouts:
        for variant in variants:
            common = dict(fields, layout=layout, route=Route.SHARDED_LOAD, variant=variant, library=LIBRARY)
            if plain:
                cases.append(Case(model, factory, **common))
            cases += [Case(model, factory, **dict(common, control=c, grads=True)) for c in controls(layout)]
    return cases


def spec_inputs(path: str, variant: str = "base", shape: Shape | None = None) -> tuple[str, Shape | None]:
    """Call a transformers factory: (the fixture whose checkpoint loads, the shape of its rows or None for the
    variant's own). SpecError names what the factory broke."""
    kwargs = dict({"variant": variant} if variant != "base" else {}, **({"shape": shape} if shape else {}))
    factory = load_factory(path)
    try:
        result = factory(**kwargs)
    except SpecError:
        raise
    except Exception as exc:  # a user's factory may raise anything
        raise SpecError(f"--spec {path!r}: calling the factory raised {type(exc).__name__}: {exc}") from exc
    if not (isinstance(result, tuple) and len(result) == 2 and result[0] in FIXTURES
            and (result[1] is None or isinstance(result[1], Shape))):
        raise SpecError(f"--spec {path!r}: a transformers factory returns (fixture, Shape or None) with the fixture "
                        f"one of {', '.join(FIXTURES)}; got {result!r:.200}")
    fixture, built = result
    return fixture, None if built is None else with_length(built, getattr(factory, "space", SPACE))


def with_length(shape: Shape, space: Space) -> Shape:
    """`shape` naming its row length: a shape that leaves it to the space takes the space's now, so the
    launcher that judges it and the ranks that build it read the same length."""
    if not shape.token_rows or TOKENS in dict(shape.lengths):
        return shape
    return dataclasses.replace(shape, lengths=((TOKENS, shape.length(space, TOKENS)),))


def shape_problems(shape: Shape, dp: int, space: Space = SPACE) -> list[str]:
    """Why rows of `shape` cannot run on a layout with `dp` data-parallel ranks (each rule in words); empty
    when they can."""
    if not shape.token_rows:
        return [f"shape {shape.describe()}: a causal LM takes rows of tokens (Shape(token_rows=True))"]
    length = shape.length(space, TOKENS)
    problems = [] if length >= 2 else [f"tokens {length}: a row needs 2 tokens, so the loss predicts one"]
    if shape.batch % dp:
        problems.append(f"batch {shape.batch}: the data-parallel degree dpr x fsdp = {dp} must divide it")
    if any(p != THIRD and not 0 <= p < length for p in shape.padded):
        problems.append(f"padded {list(shape.padded)}: each row keeps a token, so 0 <= padding < tokens {length}")
    elif shape.padded and not predicted(shape, length):
        problems.append(f"padded {list(shape.padded)} on the {shape.pad_side}: no row has a token to predict")
    if any(sum(row) != length for row in shape.documents):
        problems.append(f"packed {[list(r) for r in shape.documents]}: each row's documents add up to tokens {length}")
    return problems


def predicted(shape: Shape, length: int) -> int:
    """Tokens the causal loss predicts in rows of `length` (labels shifted by one; padded positions ignored):
    what `inputs.predicted_tokens` counts on the built batch, known before any tensor exists."""
    counts = [shape.masked_count(row, length) if shape.padded else 0 for row in range(shape.batch)]
    if shape.pad_side == "left":  # real tokens at count..length-1; position 0 is never predicted
        return sum(length - max(c, 1) for c in counts)
    return sum(length - c - 1 for c in counts)


def explore_target(factory: str, layouts_text: str, world: int) -> tuple[Space, list]:
    """What explore draws for a transformers model: its space (the factory's `space`, else the fixtures') and
    the layouts of `layouts_text` transformers builds for it. SpecError, TfLayoutError name the rule broken."""
    fixture, _ = spec_inputs(factory)
    function = load_factory(factory)
    if not any(p.name == "shape" or p.kind is p.VAR_KEYWORD for p in inspect.signature(function).parameters.values()):
        raise SpecError(f"--spec {factory!r}: explore hands each drawn Shape to the factory as shape=, and this "
                        "factory takes no shape argument")
    space = getattr(function, "space", SPACE)
    moe, cp = fixture in MOE, cp_supported()
    return space, [layout for layout in layouts(fixture, layouts_text, world) if not refusals(layout, moe, cp)]


def explore_case(name: str, factory: str, space: Space, layout, shape: Shape, dtype: str) -> Case:
    """The case explore runs for a drawn shape; ValueError names every rule it breaks (the launcher then
    rejects the draw, and no rank spends time on it)."""
    problems = shape_problems(shape, layout.dp, space)
    if dtype != "fp32":
        problems.append(f"dtype {dtype}: the transformers adapter runs fp32 only")
    if problems:
        raise ValueError("; ".join(problems))
    return Case(name, factory, layout, route=Route.SHARDED_LOAD, variant=shape.label, library=LIBRARY,
                shape=with_length(shape, space))
