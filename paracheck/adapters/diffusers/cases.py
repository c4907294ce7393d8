"""The diffusers cases one request asks for: fixtures or specs x layouts x variants x controls, as kit `Case`s.

Torch-free but for a `--spec`, whose factory is called here so a broken one fails before any rank starts (exit 2).
Used by `paracheck run` (through the adapter), the diffusers mixins and explore alike.
"""

from __future__ import annotations

from paracheck.adapters.diffusers.options import cp_options_for, parse_cp_options
from paracheck.domain.case import Case, FixtureUnavailable, call_factory, factory_variants
from paracheck.adapters.diffusers.layout import parse_layouts
from paracheck.domain.layout import Layout

LIBRARY = "diffusers"


def expand(model: str, factory: str, layouts, controls, plain: bool = True, variants=("base",),
           cp_options: tuple = (), **fields) -> list[Case]:
    """Per layout and variant: the plain case (unless `plain` is off), then one case per control name.
    `cp_options` (`--cp-options`) go to every layout with context parallelism, over the variant's own."""
    cases = []
    fields = dict(fields, library=LIBRARY)
    for layout in layouts:
        for variant in variants:
            options = tuple(sorted({**dict(cp_options_for(variant, layout)),
                                    **(dict(cp_options) if layout.has_cp else {})}.items()))
            if plain:
                cases.append(Case(model, factory, layout, variant=variant, cp_options=options, **fields))
            cases.extend(Case(model, factory, layout, variant=variant, cp_options=options,
                              **dict(fields, control=c, grads=True)) for c in controls(layout))
    return cases


def expand_request(request) -> list[Case]:
    """`request`'s diffusers cases (a `domain.adapter.CaseRequest`). ValueError names the argument and rule."""
    from paracheck.adapters.diffusers.controls import CONTROLS
    from paracheck.adapters.diffusers.pipelines import cases as pipeline_cases
    from paracheck.adapters.diffusers.pipelines.controls import PIPELINE_CONTROLS

    cp_options = parse_cp_options(request.cp_options) if isinstance(request.cp_options, str) else request.cp_options
    check_attention_backend(request.attention_backend)
    layouts = parse_layouts(request.layouts, request.nproc, request.order)
    if not layouts:
        raise ValueError(f"--nproc {request.nproc}: one rank has no parallel layout; use --nproc 2 or more")
    pipelines = {factory for _, factory in request.models if pipeline_cases.is_pipeline_factory(factory)}
    models = [(m, f) for m, f in request.models if f not in pipelines]
    built = {factory: call_factory(factory) for _, factory in models} if request.spec else {}
    if request.layouts.strip() != "all" and request.named and models:
        check_fits(models, layouts, built)
    wanted = request.variants
    fields = dict(route=request.route, grads=request.grads, dtype=request.dtype, cp_options=cp_options,
                  attention_backend=request.attention_backend)
    cases = []
    for model, factory in request.models:
        if factory in pipelines:
            cases += pipeline_cases.expand(request, model, factory, layouts,
                                           _controls(request, PIPELINE_CONTROLS), **fields)
            continue
        cases += expand(model, factory, layouts, lambda layout: _controls(request, CONTROLS),
                        plain=not request.only_control,
                        variants=[v for v in offered(model, factory) if wanted is None or v in wanted], **fields)
    return cases


def _controls(request, controls: dict) -> list[str]:
    """The controls `request` asks for that are among `controls` (another kind's go to its own cases only)."""
    names = [request.only_control] if request.only_control else (list(controls) if request.controls else [])
    return [c for c in names if c in controls]


def offered(model: str, factory: str) -> tuple[str, ...]:
    """The variants a bundled fixture or a spec offers."""
    from paracheck.adapters.diffusers.fixtures_index import FIXTURE_VARIANTS, FIXTURES

    if FIXTURES.get(model) == factory:
        return FIXTURE_VARIANTS.get(model, ("base",))
    return factory_variants(factory)


def check_attention_backend(name: str) -> None:
    """A name other than auto or paracheck's own is checked against diffusers' list (importing it, so only then)."""
    if name in ("auto", "paracheck_cpu_lse"):
        return
    from diffusers.models.attention_dispatch import AttentionBackendName

    names = [b.value for b in AttentionBackendName]
    if name not in names:
        raise ValueError(f"--attention-backend {name!r}: must be auto, paracheck_cpu_lse or one of diffusers' "
                         f"backends ({', '.join(names)})")


def check_fits(models: list[tuple[str, str]], layouts: list[Layout], built: dict) -> None:
    """Named models crossed with named layouts: the pairs that do not fit run as skips with the reason,
    but a named layout that fits none of the models, or a model that takes none of the layouts, is a
    usage error (nothing would run for it)."""
    from paracheck.adapters.diffusers.fitting import Unfittable, fit_init_dict

    misfits: dict[tuple[str, str], str] = {}
    for name, factory in models:
        try:
            model_class, init_dict, _ = built.get(factory) or call_factory(factory)
        except FixtureUnavailable as exc:  # a skip on the ranks, with this reason
            misfits.update({(name, layout.name): str(exc) for layout in layouts})
            continue
        for layout in layouts:
            try:
                fit_init_dict(model_class, init_dict, layout)
            except Unfittable as exc:
                misfits[name, layout.name] = str(exc)
    for name, _ in models:
        if all((name, layout.name) in misfits for layout in layouts):
            reasons = "; ".join(f"{layout.name}: {misfits[name, layout.name]}" for layout in layouts)
            raise ValueError(f"--models {name} takes none of --layouts {','.join(l.name for l in layouts)} ({reasons})")
    for layout in layouts:
        if all((name, layout.name) in misfits for name, _ in models):
            reasons = "; ".join(f"{name}: {misfits[name, layout.name]}" for name, _ in models)
            raise ValueError(f"--layouts {layout.name} fits none of --models "
                             f"{','.join(n for n, _ in models)} ({reasons})")
