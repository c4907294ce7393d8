"""The diffusers adapter's explore face: what `paracheck explore` draws for a diffusers model, and the case a draw
runs as. The launcher builds the inputs itself to learn whether the lengths divide the CP degree (uneven lengths run
with the library's "anything" modes, as the `uneven` variant does) and rejects what cannot run, so no rank spends
time on it.
"""

from __future__ import annotations

from paracheck.adapters.diffusers.cases import LIBRARY
from paracheck.adapters.diffusers.options import cp_options_for
from paracheck.domain.case import Case, SpecError, call_factory, load_factory
from paracheck.adapters.diffusers.layout import parse_layouts
from paracheck.domain.shapes import Shape


def explore_target(factory: str, layouts_text: str, world: int, order: str) -> tuple:
    """(space, the layouts of `layouts_text` its init dict can be fitted to); SpecError names what the factory lacks."""
    from paracheck.adapters.diffusers.fitting import Unfittable, fit_init_dict

    space = getattr(load_factory(factory), "space", None)
    if space is None:
        raise SpecError(f"--spec {factory!r}: explore needs a factory that takes shape= and has a `space` "
                        "attribute (a paracheck.domain.shapes.Space); see docs/explore.md")
    if space.token_rows:
        raise SpecError(f"--spec {factory!r}: its space has token rows, a causal LM's inputs: give the module "
                        "library = 'transformers' (see docs/explore.md)")
    # Built at its plainest shape now, so a factory that takes no shape= fails here (exit 2), not on every draw.
    model_class, init, _ = call_factory(factory, shape=Shape())
    fits = []
    for layout in parse_layouts(layouts_text, world, order) if layouts_text else []:
        try:
            fit_init_dict(model_class, init, layout, any_heads=True)
            fits.append(layout)
        except Unfittable:
            pass
    return space, fits


def draw_options(d, layout, uneven: bool) -> list:
    """The context-parallel options a draw adds (`d` draws, as in a hypothesis composite)."""
    from paracheck.explore.engine import sometimes

    options = []
    if layout.ring > 1:
        if d(sometimes(4)):
            options.append(("rotate_method", "alltoall"))
        if d(sometimes(4)):
            options.append(("convert_to_fp32", False))
    if not uneven:  # the "anything" modes on lengths that need none of them
        options += [(name, True) for name, degree in (("ulysses_anything", layout.ulysses),
                                                      ("ring_anything", layout.ring))
                    if degree > 1 and d(sometimes(4))]
    return options


def explore_case(name: str, factory: str, space, layout, shape, dtype: str, extras: dict) -> Case:
    """The case a draw runs as; ValueError when it cannot run (the launcher asks, not the ranks)."""
    from paracheck.adapters.diffusers import library
    from paracheck.adapters.diffusers.fitting import Unfittable, cp_split_problems, cp_split_sizes, fit_init_dict

    uneven = extras.get("uneven", False)
    try:
        model_class, init, inputs = call_factory(factory, shape=shape)
    except Exception as exc:
        raise ValueError(f"the factory cannot build {shape.describe()}: {exc}") from exc
    if bool(cp_split_problems(model_class, inputs, layout)) != uneven:
        raise ValueError("the lengths are not what the draw asked for (even or uneven)")
    if any(size < layout.cp for _, size in cp_split_sizes(model_class, inputs).values()):
        raise ValueError("fewer tokens than ranks: outside what any mode claims to take")
    modes = cp_options_for("uneven" if uneven else "base", layout)  # uneven lengths run as the variant does
    options = tuple(sorted(dict(extras.get("options", ()), **dict(modes)).items()))
    refused = library.cp_options_refused(layout, options)
    if refused:
        raise ValueError(refused)
    try:
        fit_init_dict(model_class, init, layout, any_heads=dict(options).get("ulysses_anything", False))
    except Unfittable as exc:
        raise ValueError(str(exc)) from exc
    variant = "masked" if shape.padded else "uneven" if uneven else shape.label
    return Case(name, factory, layout, variant=variant, dtype=dtype, cp_options=options, shape=shape,
                attention_backend=extras.get("attention_backend", "auto"), library=LIBRARY)
