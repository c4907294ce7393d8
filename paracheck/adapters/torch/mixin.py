"""The pytest mixin for torch specs: a test class names its spec (or is one) and gets structure, forward,
inference, loss, gradient and negative-control tests per layout, from one launch per class and world size.

    class TestMyLlama(TorchParallelTesterMixin):
        paracheck_spec = "examples/llama_tp_fsdp.py:spec"
        paracheck_layouts = ("tp2xfsdp2", "fsdp4")

or, the class itself the spec (its file must import on the ranks, as a test module does):

    class TestMyModel(TorchParallelTesterMixin):
        paracheck_layouts = ("tp2",)
        def build(self): ...
        def parallelize(self, model, mesh, layout): ...
        def inputs(self, layout, variant): ...

Without `paracheck_layouts`, the spec's own `layouts` of `paracheck_world` ranks run (every one of that world
when it declares none). The other `paracheck_*` attributes are those of `paracheck.pytest.mixin`.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from paracheck.adapters.torch import LIBRARY
from paracheck.domain.records import CheckId
from paracheck.pytest.mixin import ParallelTesterMixin


class TorchParallelTesterMixin(ParallelTesterMixin):
    #: "module:attribute" of the spec; None: the test class itself is the spec.
    paracheck_spec: str | None = None
    paracheck_layouts: tuple[str, ...] | None = None
    paracheck_world: int = 4
    paracheck_structure_ids = (CheckId.MESH, CheckId.TP_SHARDS)
    paracheck_library = LIBRARY

    @classmethod
    def _paracheck_spec_path(cls) -> str:
        return cls.paracheck_spec or f"{inspect.getsourcefile(cls)}:{cls.__name__}"

    @classmethod
    def _paracheck_layouts(cls) -> list:
        if cls.paracheck_layouts is not None:
            return super()._paracheck_layouts()
        from paracheck.adapters.torch import spec as specs
        from paracheck.adapters.torch.cases import layouts_of
        from paracheck.domain.adapter import CaseRequest

        path = cls._paracheck_spec_path()
        return layouts_of(path, specs.loaded(path), CaseRequest([], nproc=cls.paracheck_world))

    def _paracheck_cases(self, layouts, folder: str) -> list:
        from paracheck.adapters.torch.cases import expand
        from paracheck.domain.adapter import CaseRequest

        cls = type(self)
        if not layouts:
            return []
        request = CaseRequest([(cls.__name__, cls._paracheck_spec_path())], ",".join(l.name for l in layouts),
                              layouts[0].world, variants=list(cls.paracheck_variants),
                              controls=cls.paracheck_controls, dtype=cls.paracheck_dtype, spec=True)
        return [dataclasses.replace(c, atol=cls.paracheck_atol, rtol=cls.paracheck_rtol) for c in expand(request)]

    @pytest.mark.paracheck
    def test_paracheck_loss(self, paracheck_case, request):
        from paracheck.pytest.mixin import expect

        expect(self, request, paracheck_case, (CheckId.LOSS,))
