"""The transformers pytest mixin: a causal LM from its tester's tiny config, over the `DistributedConfig` layouts its
plans allow.

    class TestTinyLlama(TinyLlamaTester, CausalLMParallelTesterMixin):
        pass

`get_config()` returns the `PretrainedConfig`; `model_class` (optional) is the class to build. The cases are built by
`mixin_cases` and run like every mixin's (`paracheck.pytest.mixin`).
"""

from __future__ import annotations

import pytest

from paracheck.adapters.transformers import LIBRARY
from paracheck.domain.records import CheckId
from paracheck.pytest.mixin import ParallelTesterMixin, expect


class CausalLMParallelTesterMixin(ParallelTesterMixin):
    """Loaded with `from_pretrained(distributed_config=...)` on every layout of `paracheck_world` ranks its plans
    allow (`paracheck_layouts = None`), or those named."""
    paracheck_layouts: tuple[str, ...] | None = None
    paracheck_world: int = 4
    model_class = None
    paracheck_structure_ids = (CheckId.MESH, CheckId.TP_SHARDS)
    paracheck_library = LIBRARY
    #: parity.generate on every layout: greedy generation, three cache modes (`adapters.transformers.generate`).
    paracheck_generate = True

    @classmethod
    def _paracheck_layouts(cls) -> list:
        from paracheck.adapters.transformers.mixin_cases import plan_layouts

        if cls.paracheck_layouts is None:
            return plan_layouts(cls().get_config(), cls.paracheck_world)
        return super()._paracheck_layouts()

    @classmethod
    def _paracheck_refusal(cls, layout) -> str | None:
        from paracheck.adapters.transformers.mixin_cases import refusal

        return refusal(cls().get_config(), layout, cls.paracheck_dtype)

    def _paracheck_cases(self, layouts, folder: str) -> list:
        from paracheck.adapters.transformers.mixin_cases import cases, check_variants, write_checkpoint
        from paracheck.adapters.transformers.requirements import missing

        problem = missing()
        if problem:  # once for the class, as diffusers' mixin does, not once per layout's test
            pytest.fail(f"paracheck: {problem}", pytrace=False)
        cls = type(self)
        if cls.paracheck_dtype != "fp32":
            raise ValueError(f"paracheck_dtype {cls.paracheck_dtype!r}: the transformers adapter runs fp32 only")
        layouts = [layout for layout in layouts if not cls._paracheck_refusal(layout)]
        path = write_checkpoint(self.get_config(), cls.model_class, folder)
        return cases(cls.__name__, path, layouts, check_variants(cls.paracheck_variants), cls.paracheck_controls,
                     cls.paracheck_atol, cls.paracheck_rtol)

    @pytest.mark.paracheck
    def test_paracheck_loss(self, paracheck_case, request):
        expect(self, request, paracheck_case, (CheckId.LOSS,))

    @pytest.mark.paracheck
    def test_paracheck_generate(self, paracheck_case, request):
        expect(self, request, paracheck_case, (CheckId.GENERATE,))
