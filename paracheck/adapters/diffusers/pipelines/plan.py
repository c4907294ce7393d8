"""A pipeline case's plan: what every rank decides before any collective, identically (steps, cache, fit, route,
attention backend, the reference's key).

Planning builds the pipeline once and runs it up to its first transformer call (no step is taken), so the inputs
the pipeline itself builds (text lengths, image ids, a 1-D timestep, masks) are known before any rank splits them:
a length the context-parallel degree does not divide is a skip naming the input, and what the inputs carry ("mask")
is there for known-failure entries, as for a single call.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import torch

from paracheck.adapters.diffusers import library
from paracheck.adapters.diffusers.fitting import Unfittable, fit_init_dict
from paracheck.adapters.diffusers.pipelines import caches, spec
from paracheck.adapters.diffusers.pipelines.cases import LONG_STEPS, CACHE_STEPS
from paracheck.adapters.diffusers.pipelines.loop import pipeline_of
from paracheck.adapters.diffusers.plan import Stop, settle
from paracheck.checks.traits import input_traits
from paracheck.domain.case import Case, FixtureUnavailable
from paracheck.domain.records import Failure, FailureKind, RankStatus, Route
from paracheck.world.recent import Recent


@dataclass
class PipelinePlan:
    case: Case
    source: spec.Source | None = None
    transformer_class: type | None = None
    #: The transformer's init dict, fitted to the layout (heads a multiple of tp x ulysses, blocks the plans name).
    init_dict: dict = field(default_factory=dict)
    fit: list[str] = field(default_factory=list)
    steps: int = 0
    #: The cache hook the case runs (a `caches.CACHES` name), or None.
    cache: str | None = None
    route: Route | None = None
    attention: str | None = None
    stop: Stop | None = None
    key: str | None = None
    traits: list[str] = field(default_factory=list)

    def components(self) -> dict:
        """Fresh components, the transformer rebuilt to its fitted config where fitting changed it (seeded as the
        source seeds it, so every rank builds the same weights; the reference's are loaded over them anyway)."""
        components = self.source.components()
        if self.fit:
            original = components["transformer"].config
            torch.manual_seed(0)
            components["transformer"] = self.transformer_class(**self.init_dict).eval()
            heads = {k: v for k, v in self.init_dict.items() if "head" in k and original.get(k) != v}
            for name, component in components.items():
                if name.startswith("controlnet"):
                    components[name] = _heads_followed(component, heads)
        return components

    def pipeline(self, components: dict | None = None):
        return pipeline_of(self.source, self.components() if components is None else components)

    def inputs(self) -> dict:
        """The call's inputs, with the argument that makes it denoise this plan's steps."""
        return dict(self.source.inputs(0), **self.source.step_inputs(self.steps))


def _heads_followed(controlnet, heads: dict):
    """A ControlNet rebuilt with the heads fitting gave its transformer (seeded as the source seeds it): its
    residuals are added to the transformer's hidden states, so its inner dim must stay the transformer's."""
    config = {k: v for k, v in controlnet.config.items() if not k.startswith("_")}
    shared = {k: v for k, v in heads.items() if k in config}
    if not shared:
        return controlnet
    torch.manual_seed(0)
    return type(controlnet)(**dict(config, **shared)).eval()


class Sources:
    """Each pipeline source a rank runs, loaded once per process (the recent ones kept)."""

    def __init__(self):
        self._loaded = Recent(8, "diffusers pipeline source")

    def get(self, case: Case) -> spec.Source:
        return self._loaded.get((case.payload or case.factory), lambda: spec.load(case.factory, case.payload))


def steps_and_cache(source: spec.Source, variant: str) -> tuple[int, str | None]:
    """A variant's denoising steps and cache: base runs the source's own steps, `long` more, a cache variant
    enough for the cache to reuse something."""
    steps = source.default_steps()
    if variant == "long":
        return max(steps, LONG_STEPS), None
    if variant in caches.CACHES:
        return max(steps, CACHE_STEPS), variant
    return steps, None


def plan(case: Case, backend, sources: Sources) -> PipelinePlan:
    """Load the source, fit its transformer, resolve route and backend, read the first call's inputs; the same on
    every rank, no collective."""
    try:
        source = sources.get(case)
        p = PipelinePlan(case, source)
        p.steps, p.cache = steps_and_cache(source, case.variant)
        transformer = source.components()["transformer"]
    except (FixtureUnavailable, ImportError) as exc:  # a pipeline class this diffusers lacks: a skip
        reason = str(exc) if isinstance(exc, FixtureUnavailable) else (
            f"diffusers {library.installed_version()} cannot build {case.model}: {exc}")
        return PipelinePlan(case, stop=Stop(RankStatus.SKIP, reason, Failure(FailureKind.SKIP,
                                                                             exception=type(exc).__name__)))
    except Exception as exc:
        reason = f"RuntimeError: loading the pipeline source raised {type(exc).__name__}: {exc}"
        return PipelinePlan(case, stop=Stop(RankStatus.ERROR, reason, Failure.raised(exc)))
    p.transformer_class = type(transformer)
    try:
        _fit(p, transformer)
        first = first_call(p)
        p.traits = input_traits(first)
        p.route, p.attention = settle(case, backend, p.transformer_class, first)
        if case.control:
            _control_fits(case, p)
    except Unfittable as exc:
        p.stop = Stop(RankStatus.SKIP, str(exc), exc.failure)
        return p
    p.key = _key(p)
    return p


def _fit(p: PipelinePlan, transformer) -> None:
    layout, options = p.case.layout, dict(p.case.cp_options)
    refused = library.cp_options_refused(layout, p.case.cp_options)
    if refused:
        raise Unfittable(refused)
    init = {k: v for k, v in transformer.config.items() if not k.startswith("_")}
    fit = fit_init_dict(p.transformer_class, init, layout, any_heads=bool(options.get("ulysses_anything")))
    p.init_dict, p.fit = fit.init_dict, fit.changes


class _FirstCall(Exception):
    def __init__(self, kwargs: dict):
        super().__init__("the pipeline's first transformer call")
        self.kwargs = kwargs


def first_call(p: PipelinePlan) -> dict:
    """The keyword arguments of the pipeline's first transformer call (the pipeline stopped there)."""
    pipe = p.pipeline()

    def stop(module, args, kwargs):
        raise _FirstCall(kwargs)

    pipe.transformer.register_forward_pre_hook(stop, with_kwargs=True)
    try:
        with torch.no_grad():
            pipe(**dict(p.inputs(), output_type="pt", return_dict=False))
    except _FirstCall as call:
        return call.kwargs
    return {}


def _control_fits(case: Case, p: PipelinePlan) -> None:
    from paracheck.adapters.diffusers.pipelines.controls import guidance_refuses

    reason = guidance_refuses(case, p)
    if reason:
        raise Unfittable(reason)


def _key(p: PipelinePlan) -> str:
    case = p.case
    text = json.dumps([case.payload or case.factory, f"{p.transformer_class.__module__}.{p.transformer_class.__qualname__}",
                       p.init_dict, case.variant, case.dtype, p.attention, "pipeline"], sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:16]
