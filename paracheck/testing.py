"""The pytest mixins by name, every adapter's (the contract's import path):

    from paracheck.testing import HybridParallelTesterMixin

Each adapter names its mixins (`Adapter.mixins`); a name is imported from its adapter when first asked for, so
this module names no library.
"""

from __future__ import annotations

from paracheck.domain import registry


def __getattr__(name: str):
    found = registry.mixins().get(name)
    if found is None:
        raise AttributeError(f"module 'paracheck.testing' has no attribute {name!r}; mixins: "
                             f"{', '.join(registry.mixins())}")
    import importlib

    module, _, attribute = found.partition(":")
    return getattr(importlib.import_module(module), attribute)


def __dir__() -> list[str]:
    return sorted(registry.mixins())
