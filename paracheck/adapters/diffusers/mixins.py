"""The diffusers pytest mixins, in diffusers' tester-config convention:

    class TestFluxHybrid(FluxTransformerTesterConfig, HybridParallelTesterMixin):
        pass

The test class supplies `model_class` (an attribute or a property), `get_init_dict()` and `get_dummy_inputs(...)`
(given `batch_size=1` and `device="cpu"` where it takes them). Each mixin generates structure, forward, inference
(the no-grad forward), gradient and negative-control tests per layout (ids name the layout). Beyond the host's
(`paracheck.pytest.mixin`): `paracheck_attention_backend`, and `paracheck_variant_inputs(variant)` for variants
other than base and batch2.
"""

from __future__ import annotations

import inspect
import os

import pytest

from paracheck.adapters.diffusers.cases import LIBRARY, expand
from paracheck.adapters.diffusers.controls import applicable
from paracheck.pytest.mixin import ParallelTesterMixin


class DiffusersTesterMixin(ParallelTesterMixin):
    #: Input variants: "base" (batch_size=1), "batch2" (batch_size=2); others come from the class's
    #: `paracheck_variant_inputs(variant)` when it defines one.
    paracheck_variants: tuple[str, ...] = ("base",)
    #: "auto" or a diffusers attention backend name (see `paracheck.adapters.diffusers.attention.choose`).
    paracheck_attention_backend: str = "auto"
    paracheck_library = LIBRARY

    def _paracheck_cases(self, layouts, folder: str) -> list:
        """This class's cases on `layouts`, their models and inputs written under `folder` for the ranks."""
        from paracheck.adapters.diffusers.library import unsupported

        problem = unsupported()
        if problem:
            pytest.fail(f"paracheck: {problem}", pytrace=False)
        cls = type(self)
        variants = [v for v in cls.paracheck_variants if _dump_variant(self, folder, v)]
        controls = applicable if cls.paracheck_controls else (lambda layout: [])
        return expand(cls.__name__, "payload", layouts, controls, variants=variants, payload=folder,
                      atol=cls.paracheck_atol, rtol=cls.paracheck_rtol, dtype=cls.paracheck_dtype,
                      attention_backend=cls.paracheck_attention_backend)


class HybridParallelTesterMixin(DiffusersTesterMixin):
    """TP x Ulysses on one shared mesh (the composed route where the library refuses both)."""
    paracheck_layouts = ("tp2xu2",)


class TensorParallelTesterMixin(DiffusersTesterMixin):
    paracheck_layouts = ("tp2", "tp4")


class ContextParallelTesterMixin(DiffusersTesterMixin):
    paracheck_layouts = ("u2", "u4", "r2", "r4")


def _dump_variant(test, folder: str, variant: str) -> bool:
    """Write the variant's model and inputs for the ranks; False when the class cannot make them."""


    from paracheck.adapters.diffusers.payload import dump

    inputs = _variant_inputs(test, variant)
    if inputs is None:
        return False
    dump(os.path.join(folder, variant), test.model_class, test.get_init_dict(), inputs)
    return True


def _variant_inputs(test, variant: str):
    custom = getattr(test, "paracheck_variant_inputs", None)
    if custom is not None and variant not in ("base", "batch2"):
        return custom(variant)
    method = test.get_dummy_inputs
    parameters = inspect.signature(method).parameters
    kwargs = {"device": "cpu"} if "device" in parameters else {}
    if "batch_size" in parameters:
        kwargs["batch_size"] = 2 if variant == "batch2" else 1
    elif variant == "batch2":
        return custom(variant) if custom else None
    return method(**kwargs) if variant in ("base", "batch2") else None


