"""`DiffusersPipelineParallelTesterMixin`: a pipeline test class in diffusers' pipeline-tester convention gets the
pipeline checks by inheriting it.

    class TestFluxPipelineParallel(FluxPipelineTesterConfig, DiffusersPipelineParallelTesterMixin):
        paracheck_layouts = ("tp2", "u2")

The class supplies `pipeline_class`, `get_dummy_components()` and `get_dummy_inputs(device, seed)` (or diffusers'
newer `get_dummy_inputs()` with `get_generator(seed)`); components must be picklable (the libraries' own classes
are), since the pytest process builds them once and hands them to the ranks in one file (`spec.dump`). Tests per
layout: the structure checks on the pipeline's transformer, `parity.pipeline`, and the pipeline controls that apply.
Beyond the host's attributes (`paracheck.pytest.mixin`): `paracheck_attention_backend`, and `paracheck_variants`
among base, long and the cache variants.
"""

from __future__ import annotations

import pytest

from paracheck.adapters.diffusers.pipelines import cases as pipeline_cases, spec
from paracheck.adapters.diffusers.pipelines.controls import PIPELINE_CONTROLS, planted_on
from paracheck.domain.adapter import CaseRequest
from paracheck.domain.control import applicable_to
from paracheck.domain.records import CheckId
from paracheck.pytest.mixin import ParallelTesterMixin, expect

PAYLOAD = pipeline_cases.PAYLOAD


class DiffusersPipelineParallelTesterMixin(ParallelTesterMixin):
    paracheck_layouts = ("tp2", "u2")
    paracheck_library = pipeline_cases.LIBRARY
    paracheck_attention_backend: str = "auto"
    paracheck_structure_ids = (CheckId.MESH, CheckId.CP_HOOKS, CheckId.PROCESSOR_CONFIG, CheckId.TP_SHARDS)

    # A pipeline runs the transformer's forward many times and never its backward: these are the model mixins'.
    test_paracheck_forward = test_paracheck_inference = test_paracheck_grads = test_paracheck_training = None

    @pytest.mark.paracheck
    def test_paracheck_pipeline(self, paracheck_case, request):
        expect(self, request, paracheck_case, (CheckId.PIPELINE,))

    @classmethod
    def _paracheck_applicable(cls, layout) -> list[str]:
        """The pipeline controls planted on the base variant that `layout` can show."""
        return [c for c in applicable_to(PIPELINE_CONTROLS, layout) if planted_on(c) == "base"]

    def _paracheck_cases(self, layouts, folder: str) -> list:
        from paracheck.adapters.diffusers.library import unsupported

        problem = unsupported()
        if problem:
            pytest.fail(f"paracheck: {problem}", pytrace=False)
        cls = type(self)
        spec.dump(folder, self)
        request = CaseRequest([(cls.__name__, PAYLOAD)], ",".join(layout.name for layout in layouts),
                              variants=list(cls.paracheck_variants), controls=cls.paracheck_controls, named=True)
        controls = [c for c in PIPELINE_CONTROLS if planted_on(c) in cls.paracheck_variants] if cls.paracheck_controls \
            else []
        return pipeline_cases.expand(request, cls.__name__, PAYLOAD, layouts, controls, payload=folder,
                                     atol=cls.paracheck_atol, rtol=cls.paracheck_rtol, dtype=cls.paracheck_dtype,
                                     attention_backend=cls.paracheck_attention_backend)
