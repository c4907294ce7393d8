"""Library adapters beside diffusers: which libraries a case may name, and each one's rank-side entry point.

The diffusers path is the kit's own modules (`routes`, `library`, `reference`); another library's cases are
handed whole to its adapter's `run_case(index, case, backend, workdir) -> RankResult` by `worker.plan_and_run`.
"""

from __future__ import annotations

import importlib

DEFAULT = "diffusers"
#: library name -> "module:function" of its rank-side entry point.
RANK_ENTRIES = {"transformers": "paracheck.adapters.transformers.rank:run_case"}
LIBRARIES = (DEFAULT, *RANK_ENTRIES)


def rank_entry(library: str):
    """The rank-side entry point of `library`'s adapter; ValueError names the libraries there are."""
    if library not in RANK_ENTRIES:
        raise ValueError(f"library {library!r}: adapters exist for {', '.join(RANK_ENTRIES)} "
                         f"({DEFAULT} runs through the kit's own routes)")
    module, _, function = RANK_ENTRIES[library].partition(":")
    return getattr(importlib.import_module(module), function)


def parse_layout(library: str, name: str, order: str = "cp-fastest"):
    """A layout name read by `library`'s grammar (the kit's own for diffusers)."""
    if library == "transformers":
        from paracheck.adapters.transformers.layout import TfLayout

        return TfLayout.parse(name)
    from paracheck.domain.layout import Layout

    return Layout.parse(name, order)
