"""The transformers adapter's face to the kit (`ADAPTER`, entry point `paracheck.adapters:transformers`): the
`DistributedConfig` layout grammar, the tiny causal-LM fixtures, case expansion, controls and explore face, torch-free;
the rank side is `body.case_body`.
"""

from __future__ import annotations

from paracheck.adapters.transformers import LIBRARY
from paracheck.domain.records import CheckId


class TransformersAdapter:
    name = LIBRARY
    dtypes = ("fp32",)
    columns = (CheckId.MESH, CheckId.TP_SHARDS, CheckId.FORWARD, CheckId.INFERENCE, CheckId.GRADS, CheckId.LOSS)

    def parse_layout(self, name: str, order: str = "cp-fastest"):
        from paracheck.adapters.transformers.layout import TfLayout

        return TfLayout.parse(name)

    def fixtures(self) -> dict[str, str]:
        from paracheck.adapters.transformers.cases import factory_of
        from paracheck.adapters.transformers.fixtures import FIXTURES

        return {name: factory_of(name) for name in FIXTURES}

    def installed(self) -> bool:
        import importlib.util

        return importlib.util.find_spec("transformers") is not None

    def unsupported(self) -> str | None:
        if not self.installed():
            return "transformers is not installed (pip install 'paracheck[transformers]')"
        from paracheck.adapters.transformers.requirements import missing

        return missing()  # a requirement the library's loading asks for, missing: one line before any rank

    def claims(self, factory) -> bool:
        return False  # a transformers spec says so: `library = "transformers"`

    def variants(self) -> tuple[str, ...]:
        from paracheck.adapters.transformers.fixtures import VARIANTS

        return VARIANTS

    def controls(self) -> dict:
        from paracheck.adapters.transformers.controls import CONTROLS

        return CONTROLS

    def per_rank_refusal(self, name: str) -> str | None:
        from paracheck.adapters.transformers.controls import per_rank_refusal

        return per_rank_refusal(name)

    def expand(self, request) -> list:
        """Each fixture's or spec's cases: a fixture runs the variants asked for (its base inputs alone where
        --variants is unset), a spec every variant it offers that was asked for."""
        from paracheck.adapters.transformers.cases import expand, factory_of

        cases = []
        for model, factory in request.models:
            spec = None if factory == factory_of(model) else factory
            variants = request.variants or (list(self.variants()) if spec else ["base"])
            cases += expand(model, request.layouts, request.nproc, variants, request.controls, request.only_control,
                            request.grads, spec, dtype=request.dtype)
        return cases

    def case_options(self, case) -> list[str]:
        return []

    def models_option(self, case) -> list[str] | None:
        """How a replay names a sweep family's model (`--models transformers:NAME`); None for the others."""
        from paracheck.adapters.transformers.sweep import FACTORY, PREFIX

        return ["--models", PREFIX + case.model] if case.factory == FACTORY else None

    def will_run(self, case) -> bool:
        """False for a control on a bundled fixture that cannot carry it (a skip on the ranks): one that unties a
        tied head on a fixture whose config does not tie (so the tier runs it where one does)."""
        from paracheck.adapters.transformers.cases import factory_of
        from paracheck.adapters.transformers.controls import PLANTS
        from paracheck.adapters.transformers.fixtures import CONFIGS

        plant = PLANTS.get(case.control) if case.control else None
        if plant is None or not plant.trainer_needs_tied or case.payload or case.factory != factory_of(case.model):
            return True
        return bool(CONFIGS.get(case.model, ("", {}))[1].get("tie_word_embeddings"))

    def generates(self, case) -> bool:
        """Every causal LM generates: parity.generate runs where the tier turns it on."""
        return True

    def case_body(self, ctx):
        from paracheck.adapters.transformers.body import case_body

        return case_body(ctx)

    def local_scope(self):
        """In a local world (`--local-world`): transformers' per-rank functions run per rank (`library.PER_RANK`)."""
        from paracheck.adapters.transformers.library import per_rank_regions

        return per_rank_regions()

    def local_limit(self, case):
        """In a local world: an expert-parallel layout is a limit known before it runs (`library.EP_LOCAL_LIMIT`)."""
        from paracheck.adapters.transformers.library import EP_LOCAL_LIMIT

        return EP_LOCAL_LIMIT if getattr(case.layout, "ep", 1) > 1 else None

    def preload(self) -> None:
        try:  # the fixtures' classes load lazily
            import transformers  # noqa: F401
            import transformers.distributed  # noqa: F401
        except ImportError:
            return
        from paracheck.adapters.transformers import body  # noqa: F401

    def explore_target(self, factory: str, layouts_text: str, world: int, order: str = "cp-fastest"):
        from paracheck.adapters.transformers.cases import explore_target

        return explore_target(factory, layouts_text, world)

    def explore_case(self, name, factory, space, layout, shape, dtype, extras=None):
        from paracheck.adapters.transformers.cases import explore_case

        return explore_case(name, factory, space, layout, shape, dtype)

    def sweep(self, request):
        """`paracheck run --models transformers:all` (or `:NAME,...`): every causal-LM family (`sweep`)."""
        from paracheck.adapters.transformers.sweep import prepare

        return prepare(request)

    def mixins(self) -> dict[str, str]:
        return {"CausalLMParallelTesterMixin": "paracheck.adapters.transformers.mixins:CausalLMParallelTesterMixin"}


ADAPTER = TransformersAdapter()
