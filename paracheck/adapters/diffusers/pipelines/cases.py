"""The pipeline cases one request asks for, torch-free: per pipeline its layouts, variants and controls.

Variants: `base` (the pipeline's own few steps), `long` (more steps, so an error that grows has room to), and one
per diffusers cache hook (`fixtures_index.CACHE_VARIANTS`: the same cache on one device and on the parallel
pipeline). The default run (`paracheck run` with nothing named) takes one case per pipeline, on one layout of the
kind `fixtures_index.PIPELINE_DEFAULT_KIND` gives it (none for `PIPELINE_NOT_DEFAULT`), through the route `PIPELINE_DEFAULT_ROUTE` gives it (some
load their transformer with a `parallel_config`); naming the models, the layouts or the variants, or `--all`, takes
the matrix they name (cache variants only with `--all`, on the layouts of one kind of parallelism, or by name).
With `--all` and `--route auto`, each layout
that needs one kind of parallelism alone also takes the base case through `sharded-load`: both ways a user makes
a pipeline's transformer parallel.
"""

from __future__ import annotations

from paracheck.adapters.diffusers.fixtures_index import (CACHE_VARIANTS, PIPELINE_DEFAULT_KIND, PIPELINE_DEFAULT_ROUTE,
                                                         PIPELINE_FIXTURES, PIPELINE_NOT_DEFAULT, PIPELINE_VARIANTS)
from paracheck.adapters.diffusers.pipelines.controls import planted_on
from paracheck.domain.case import Case
from paracheck.domain.tier import layout_kind

#: The `long` variant's denoising steps, and a cache variant's (enough for every bundled cache config to reuse).
LONG_STEPS = 8
CACHE_STEPS = 6
LIBRARY = "diffusers"
#: The factory a pipeline mixin's cases name: their source is the payload file it wrote (`spec.dump`).
PAYLOAD = "pipeline-payload"


def is_pipeline_factory(factory: str) -> bool:
    """Whether `factory` names a pipeline source: a bundled pipeline fixture, or a class in diffusers'
    pipeline-tester convention (imported to tell)."""
    if factory in PIPELINE_FIXTURES.values() or factory == PAYLOAD:
        return True
    if factory == "payload":  # a model mixin's
        return False
    from paracheck.domain.case import SpecError, load_object

    try:
        obj = load_object(factory)
    except SpecError:
        return False
    return all(hasattr(obj, n) for n in ("pipeline_class", "get_dummy_components", "get_dummy_inputs"))


def offered(model: str) -> tuple[str, ...]:
    """The variants a pipeline offers: every one for a bundled fixture; base, long and the caches for a spec."""
    return PIPELINE_VARIANTS


def default_only(request) -> bool:
    """The default run: nothing named, no `--all`. It takes one case per pipeline."""
    return (request.layouts.strip() == "all" and not request.everything and request.variants is None
            and not request.named)


def default_layout(model: str, layouts: list):
    """The one layout of a pipeline's default case: the first of the kind its transformer is checked on by
    default (one CP and one TP layout between the pipelines whose transformer has both), else the first."""
    kind = PIPELINE_DEFAULT_KIND.get(model)
    return next((layout for layout in layouts if layout_kind(layout.name) == kind), layouts[0])


def one_kind(layout) -> bool:
    """A layout of one kind of parallelism (tp, ulysses or ring alone): where `--all` runs each cache variant."""
    return sum(degree > 1 for degree in (layout.tp, layout.ring, layout.ulysses)) == 1


def expand(request, model: str, factory: str, layouts: list, controls: list[str], cp_options: tuple = (),
           **fields) -> list[Case]:
    """One pipeline's cases: per layout and variant the plain case, then its controls (`cp_options` on the layouts
    with context parallelism)."""
    wanted = request.variants
    if default_only(request) and model in PIPELINE_NOT_DEFAULT:
        return []
    if default_only(request):
        layouts, variants = [default_layout(model, layouts)], ["base"]
        if fields.get("route", "auto") == "auto":
            fields["route"] = PIPELINE_DEFAULT_ROUTE.get(model, "auto")
    else:
        variants = [v for v in offered(model) if (v in wanted if wanted is not None else
                                                   request.everything or v not in CACHE_VARIANTS + ("long",))]
    loaded = request.everything and fields.get("route", "auto") == "auto" and "base" in variants
    cases = []
    planted = {planted_on(c) for c in controls}
    for layout in layouts:
        fields["cp_options"] = tuple(sorted(dict(cp_options).items())) if layout.has_cp else ()
        for variant in variants + [v for v in PIPELINE_VARIANTS if v in planted and v not in variants]:
            if variant in CACHE_VARIANTS and not one_kind(layout) and not (wanted and variant in wanted):
                continue
            if not request.only_control:
                cases.append(Case(model, factory, layout, variant=variant, library=LIBRARY, **fields))
            cases.extend(Case(model, factory, layout, variant=variant, library=LIBRARY, control=c, **fields)
                         for c in controls if planted_on(c) == variant)
        if loaded and not request.only_control and layout.has_tp != layout.has_cp:
            cases.append(Case(model, factory, layout, library=LIBRARY, **dict(fields, route="sharded-load")))
    return cases
