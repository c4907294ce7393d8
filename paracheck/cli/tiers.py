"""Which tier `paracheck run` runs: the quick tier (`domain.tier`) by default, the whole matrix on `--all` or when
`--variants` names the inputs to run."""

from __future__ import annotations


def add_all(parser) -> None:
    parser.add_argument("--all", action="store_true", help="the whole matrix: every variant of every model on every "
                        "layout (default: the quick tier, every model and layout with one variant each, every "
                        "(model, variant) and (layout kind, variant) pair and every declared known failure met once)")


def choose(args, cases: list) -> list:
    """`cases` as built (the full matrix), or their quick tier."""
    if getattr(args, "all", False) or args.variants is not None:
        return cases
    from paracheck.adapters.diffusers.fixtures_index import FIXTURE_CLASSES, FIXTURES
    from paracheck.domain.tier import quick
    from paracheck.results import known

    entries = known.load(known.SHIPPED if args.known_failures is None else args.known_failures)
    classes = dict(zip(FIXTURES, FIXTURE_CLASSES))
    extras = [(f"{i}:{e.reason[:40]}", lambda c, e=e: e.may_meet(c, classes.get(c.model, "")))
              for i, e in enumerate(entries)]
    return quick(cases, extras)
