"""The diffusers adapter's face to the kit (`ADAPTER`, entry point `paracheck.adapters:diffusers`): its layout grammar,
fixtures, variants, case expansion and controls, torch-free; the rank side is `body.case_body`.
"""

from __future__ import annotations

from paracheck.adapters.diffusers import options
from paracheck.adapters.diffusers.fixtures_index import FIXTURES, PIPELINE_FIXTURES, PIPELINE_VARIANTS, VARIANTS
from paracheck.domain.case import Case
from paracheck.adapters.diffusers.layout import DiffusersLayout
from paracheck.domain.layout import Layout
from paracheck.domain.records import CheckId

LIBRARY = "diffusers"


class DiffusersAdapter:
    name = LIBRARY
    dtypes = ("fp32", "bf16", "fp16")
    columns = (CheckId.MESH, CheckId.CP_HOOKS, CheckId.PROCESSOR_CONFIG, CheckId.TP_SHARDS, CheckId.COLLECTIVES,
               CheckId.FORWARD, CheckId.INFERENCE, CheckId.GRADS)

    def parse_layout(self, name: str, order: str = "cp-fastest") -> Layout:
        return DiffusersLayout.parse(name, order)

    def fixtures(self) -> dict[str, str]:
        return dict(FIXTURES, **PIPELINE_FIXTURES)

    def groups(self) -> dict[str, list[str]]:
        """Names `--models` takes for several fixtures at once: `pipelines`, every pipeline fixture."""
        return {"pipelines": list(PIPELINE_FIXTURES)}

    def installed(self) -> bool:
        import importlib.util

        return importlib.util.find_spec("diffusers") is not None

    def unsupported(self) -> str | None:
        from paracheck.adapters.diffusers.library import unsupported

        return unsupported()

    def claims(self, factory) -> bool:
        """A plain factory function returning (model_class, init_dict, inputs): diffusers' spec convention."""
        return callable(factory) and not hasattr(factory, "build")

    def variants(self) -> tuple[str, ...]:
        return VARIANTS + tuple(v for v in PIPELINE_VARIANTS if v not in VARIANTS)

    def controls(self) -> dict:
        from paracheck.adapters.diffusers.controls import CONTROLS
        from paracheck.adapters.diffusers.pipelines.controls import PIPELINE_CONTROLS

        return dict(CONTROLS, **PIPELINE_CONTROLS)

    def per_rank_refusal(self, name: str) -> str | None:
        """A model control is planted once per rank by `routes.apply`, a pipeline's too, where its planter plants it."""
        from paracheck.adapters.diffusers import controls
        from paracheck.adapters.diffusers.pipelines import controls as pipeline_controls

        if name in pipeline_controls.PIPELINE_CONTROLS:
            return pipeline_controls.per_rank_refusal(pipeline_controls.PIPELINE_CONTROLS[name])
        return controls.per_rank_refusal(controls.CONTROLS[name])

    def expand(self, request) -> list[Case]:
        """The diffusers cases of `request` (see `expand_request`)."""
        from paracheck.adapters.diffusers.cases import expand_request

        return expand_request(request)

    def case_options(self, case: Case) -> list[str]:
        """The `paracheck run` options beyond the generic ones that pick `case` out again (replay commands)."""
        args = []
        if case.attention_backend != "auto":
            args += ["--attention-backend", case.attention_backend]
        if case.cp_options != options.cp_options_for(case.variant, case.layout):
            args += ["--cp-options", options.options_text(case.cp_options)]
        return args

    def will_run(self, case) -> bool:
        """False for a bundled fixture on a layout needing a plan its class lacks (a skip on the ranks)."""
        from paracheck.adapters.diffusers.fixtures_index import FIXTURE_PLANS, PIPELINE_TRANSFORMERS

        model = PIPELINE_TRANSFORMERS.get(case.model, case.model)
        if self.fixtures().get(case.model) != case.factory:
            return True
        have = FIXTURE_PLANS.get(model, ("tp", "cp"))
        return (not case.layout.has_tp or "tp" in have) and (not case.layout.has_cp or "cp" in have)

    def class_name(self, case) -> str:
        """The model class a bundled fixture builds (known-failure entries may name it), without importing it."""
        from paracheck.adapters.diffusers.fixtures_index import FIXTURE_CLASSES, PIPELINE_TRANSFORMERS

        return dict(zip(FIXTURES, FIXTURE_CLASSES)).get(PIPELINE_TRANSFORMERS.get(case.model, case.model), "")

    def case_body(self, ctx):
        from paracheck.adapters.diffusers.body import case_body

        return case_body(ctx)

    def local_scope(self):
        """In a local world (`--local-world`): diffusers' per-rank functions run per rank (`library.PER_RANK`)."""
        from paracheck.adapters.diffusers.library import per_rank_regions

        return per_rank_regions()

    def preload(self) -> None:
        from paracheck.adapters.diffusers import preload  # noqa: F401

    def explore_target(self, factory: str, layouts_text: str, world: int, order: str = "cp-fastest"):
        from paracheck.adapters.diffusers.explore import explore_target

        return explore_target(factory, layouts_text, world, order)

    def explore_case(self, name, factory, space, layout, shape, dtype, extras=None):
        from paracheck.adapters.diffusers.explore import explore_case

        return explore_case(name, factory, space, layout, shape, dtype, extras or {})

    def draw_options(self, d, layout, uneven: bool) -> list:
        from paracheck.adapters.diffusers.explore import draw_options

        return draw_options(d, layout, uneven)

    def topology_layouts(self, backend, world: int, heads: int, layouts, order: str) -> list:
        from paracheck.adapters.diffusers.topology import topology_layouts

        return topology_layouts(backend, world, heads, layouts, order)

    # `paracheck topology --simulate`: this adapter's models on meta under torch's fake process group.
    def topology_simulate(self, request) -> int:
        from paracheck.adapters.diffusers.topology import topology_simulate

        return topology_simulate(request)

    def mixins(self) -> dict[str, str]:
        where = "paracheck.adapters.diffusers.mixins:"
        mixins = {name: where + name for name in ("HybridParallelTesterMixin", "TensorParallelTesterMixin",
                                                    "ContextParallelTesterMixin")}
        name = "DiffusersPipelineParallelTesterMixin"
        return dict(mixins, **{name: f"paracheck.adapters.diffusers.pipelines.mixin:{name}"})


ADAPTER = DiffusersAdapter()

