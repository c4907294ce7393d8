"""The torch cases a run asks for: per spec, layout and variant, the plain case, then the controls, as kit `Case`s.

Every spec is loaded and validated, and its `inputs` called for each layout and variant, before any rank starts:
a broken spec is a `SpecError` naming what is wrong (exit 2). A layout the spec refuses runs as a skip with the
spec's reason; when every layout of a spec is refused, nothing would run, so that is a `SpecError` too.
"""

from __future__ import annotations

from paracheck.adapters.torch import LIBRARY
from paracheck.adapters.torch import spec as specs
from paracheck.adapters.torch.controls import CONTROLS
from paracheck.adapters.torch.layout import TorchLayoutError, parse_layouts
from paracheck.domain.case import Case, SpecError
from paracheck.domain.records import Route

DTYPES = ("fp32",)


def expand(request) -> list[Case]:
    """`request`: a `domain.adapter.CaseRequest` whose models are (name, spec path) pairs."""
    if request.dtype not in DTYPES:
        raise SpecError(f"--dtype {request.dtype}: the torch adapter runs {', '.join(DTYPES)} only")
    names = [request.only_control] if request.only_control else (list(CONTROLS) if request.controls else [])
    cases = []
    for model, path in request.models:
        spec = specs.loaded(path)
        layouts = layouts_of(path, spec, request)
        wanted = [v for v in spec.variants if request.variants is None or v in request.variants]
        if not wanted:
            raise SpecError(f"--variants {','.join(request.variants)}: the spec {path!r} offers "
                            f"{', '.join(spec.variants)}")
        refused = {}
        for layout in layouts:
            refused[layout.name] = specs.refusal(spec, layout)
            for variant in wanted:
                if refused[layout.name] is None:
                    specs.call_inputs(path, spec, layout, variant)  # raises a SpecError naming what it broke
                fields = dict(layout=layout, route=Route.NATIVE, variant=variant, library=LIBRARY, grads=request.grads)
                if not request.only_control:
                    cases.append(Case(model, path, **fields))
                cases += [Case(model, path, **dict(fields, control=c, grads=True)) for c in names if c in CONTROLS]
        if layouts and all(refused.values()):
            reasons = "; ".join(f"{name}: {why}" for name, why in refused.items())
            raise SpecError(f"--spec {path!r} refuses every layout asked for ({reasons})")
    return cases


def layouts_of(path: str, spec, request) -> list:
    """`--layouts` read by the torch grammar; `all` is the spec's own layouts of this world, else every layout of
    the world (cp ones only where the spec declares them, pp ones only where it has a pipeline)."""
    try:
        if request.layouts.strip() == "all":
            own = specs.declared(spec, request.nproc)
            layouts = own if own is not None else [l for l in parse_layouts("all", request.nproc)
                                                   if l.cp == 1 and (l.pp == 1 or spec.pipeline is not None)]
        else:
            layouts = parse_layouts(request.layouts, request.nproc)
    except TorchLayoutError as exc:
        raise SpecError(str(exc)) from exc
    if not layouts:
        raise SpecError(f"--spec {path!r}: none of its layouts ({', '.join(spec.layouts or ())}) has "
                        f"{request.nproc} ranks (--nproc)")
    return layouts
