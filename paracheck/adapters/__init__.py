"""Library adapters: which libraries a case may name, each one's layout grammar and rank-side entry point.

`rank.worker.plan_and_run` hands every case whole to its library's `run_case(case, backend, site) -> RankResult`
(`site`: a `world.site.CaseSite`); everything library-specific (plans, routes, hooks, fitting, fixtures,
references, the library's checks) sits behind that call.
"""

from __future__ import annotations

import importlib

DEFAULT = "diffusers"
#: library name -> "module:function" of its rank-side entry point.
RANK_ENTRIES = {"diffusers": "paracheck.adapters.diffusers.rank:run_case",
                "transformers": "paracheck.adapters.transformers.rank:run_case",
                "torch": "paracheck.adapters.torch.rank:run_case"}
LIBRARIES = tuple(RANK_ENTRIES)
#: library name -> "module:attribute" of its negative controls (name -> `domain.control.Control`), torch-free.
CONTROL_TABLES = {"diffusers": "paracheck.adapters.diffusers.controls:CONTROLS",
                  "transformers": "paracheck.adapters.transformers.controls:CONTROLS",
                  "torch": "paracheck.adapters.torch.controls:CONTROLS"}
#: library name -> the torch-free module of its explore face: `explore_target(factory, layouts_text, world) ->
#: (space, layouts)` and `explore_case(name, factory, space, layout, shape, dtype) -> Case`. diffusers has none:
#: `explore.engine` fits its init dicts and CP splits itself.
EXPLORE_FACES = {"transformers": "paracheck.adapters.transformers.cases"}


def controls(library: str | None = None) -> dict:
    """Every adapter's controls by name (or `library`'s): what a run plants and the results judge by."""
    out = {}
    for name in [library] if library else CONTROL_TABLES:
        out.update(_load(CONTROL_TABLES[name]))
    return out


def get_control(name: str):
    """A control by name, whichever adapter plants it; ValueError names them all."""
    registry = controls()
    if name not in registry:
        raise ValueError(f"control {name!r}: must be one of {', '.join(registry)}")
    return registry[name]


def _load(path: str):
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


def rank_entry(library: str):
    """The rank-side entry point of `library`'s adapter; ValueError names the libraries there are."""
    if library not in RANK_ENTRIES:
        raise ValueError(f"library {library!r}: adapters exist for {', '.join(RANK_ENTRIES)}")
    return _load(RANK_ENTRIES[library])


def parse_layout(library: str, name: str, order: str = "cp-fastest"):
    """A layout name read by `library`'s grammar (the kit's own for diffusers)."""
    if library == "transformers":
        from paracheck.adapters.transformers.layout import TfLayout

        return TfLayout.parse(name)
    if library == "torch":
        return _load("paracheck.adapters.torch.adapter:ADAPTER").parse_layout(name, order)
    from paracheck.domain.layout import Layout

    return Layout.parse(name, order)


def explore_target(library: str, factory: str, layouts_text: str, world: int):
    """(space, layouts) explore draws for `library`'s model built by `factory`; its errors name the rule."""
    return _explore_face(library).explore_target(factory, layouts_text, world)


def explore_case(library: str, name: str, factory: str, space, layout, shape, dtype: str):
    """The `Case` explore runs for a drawn shape of `library`'s model; ValueError names the rules it breaks."""
    return _explore_face(library).explore_case(name, factory, space, layout, shape, dtype)


def _explore_face(library: str):
    if library not in EXPLORE_FACES:
        raise ValueError(f"library {library!r}: explore faces exist for {', '.join(EXPLORE_FACES)}")
    return importlib.import_module(EXPLORE_FACES[library])
