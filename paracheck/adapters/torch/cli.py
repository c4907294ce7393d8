"""Interim routing of `paracheck run --spec` to the torch adapter, until the kit's registry expands every
adapter's cases through `Adapter.expand`: which named models are torch specs, and their cases."""

from __future__ import annotations


def split(args, models: list[tuple[str, str]]) -> tuple[list, list]:
    """(the torch specs among `models`, the rest): only `--spec` entries can be torch specs."""
    if not args.spec:
        return [], models
    from paracheck.adapters.torch.spec import claims, load

    mine = [(m, f) for m, f in models if claims(load(f))]
    return mine, [pair for pair in models if pair not in mine]


def cases(args, models: list[tuple[str, str]]) -> list:
    if not models:
        return []
    from paracheck.adapters.torch.cases import expand
    from paracheck.domain.adapter import CaseRequest

    variants = None if args.variants is None or args.variants.strip() == "all" else \
        [v.strip() for v in args.variants.split(",") if v.strip()]
    return expand(CaseRequest(models, args.layouts, args.nproc, args.order, variants, args.controls,
                              args.only_control, not args.no_grads, args.dtype, spec=True))
