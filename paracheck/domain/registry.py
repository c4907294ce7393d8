"""The adapters this installation has: found through the entry-point group `paracheck.adapters`, never named.

Each entry names an object implementing `domain.adapter.Adapter`; it is checked against the contract
(`domain.adapter.ADAPTER`) as it loads, and the host sees it bound: every declared member there, the host's
default for an optional one it lacks, nothing else. Loading one imports its adapter module only
(torch-free by the protocol's rule), so help, usage errors and `topology` stay quick. Everything the host asks of a
library goes through here: which adapter a case, a fixture or a `--spec` belongs to, its layout grammar, its
controls, its mixins.
"""

from __future__ import annotations

from functools import lru_cache
from importlib.metadata import entry_points

GROUP = "paracheck.adapters"


class AdapterError(ValueError):
    """A library, fixture or spec no installed adapter serves; the message names what there is."""


@lru_cache(maxsize=1)
def adapters() -> dict:
    """name -> adapter, in the order the entry points are declared (stable across runs)."""
    from paracheck.domain.adapter import ADAPTER
    from paracheck.domain.contract import ContractError

    found = {}
    for entry in entry_points(group=GROUP):
        loaded = entry.load()
        try:
            adapter = ADAPTER.bind(loaded, entry.name)
        except ContractError as exc:
            raise AdapterError(f"entry point {entry.name!r} in {GROUP} ({entry.value}): {exc}") from None
        if adapter.name != entry.name:
            raise AdapterError(f"entry point {entry.name!r} in {GROUP}: its adapter calls itself {adapter.name!r}")
        found[entry.name] = adapter
    if not found:
        raise AdapterError(f"no adapter is registered in the entry-point group {GROUP!r}: reinstall paracheck")
    return found


def adapter(library: str):
    """The adapter of `library`; AdapterError names the ones there are."""
    every = adapters()
    if library not in every:
        raise AdapterError(f"library {library!r}: adapters exist for {', '.join(every)}")
    return every[library]


def parse_layout(library: str, name: str, order: str = "cp-fastest"):
    """A layout name read by `library`'s grammar."""
    return adapter(library).parse_layout(name, order)


def controls(library: str | None = None) -> dict:
    """Every adapter's negative controls by name (or `library`'s), each adapter's checked once (`_controls_of`)."""
    out = {}
    for name, each in adapters().items():
        if library in (None, name):
            out.update(_controls_of(name, each))
    return out


@lru_cache(maxsize=None)
def _controls_of(name: str, each) -> dict:
    """Adapter `each`'s (registered as `name`) controls, checked once a process for each adapter object: a control asking to be planted once per rank
    (`Control.per_rank`) where its adapter cannot honour that is an AdapterError naming both and why (in a local
    world it would be planted once for every rank, silently another bug). The first call asks for them early: the
    run expands its cases from them before any rank starts."""
    own = each.controls()
    for control in own.values():
        if control.per_rank and (why := each.per_rank_refusal(control.name)):
            raise AdapterError(f"adapter {name!r}: control {control.name!r} asks to be planted once per rank "
                               f"(Control.per_rank), which the adapter refuses: {why}")
    return own


def get_control(name: str):
    """A control by name, whichever adapter plants it; ValueError names them all."""
    every = controls()
    if name not in every:
        raise ValueError(f"control {name!r}: must be one of {', '.join(every)}")
    return every[name]


def fixtures() -> dict[str, tuple[str, str]]:
    """Every installed adapter's bundled fixtures: name -> (library, factory path)."""
    return {name: (library, factory) for library, each in adapters().items() for name, factory in each.fixtures().items()}


def library_of(factory: str) -> str:
    """Whose model `factory` builds: a bundled fixture's adapter; else the `library` a spec names; else the one
    adapter that claims the spec. SpecError when none or several do."""
    from paracheck.domain.case import SpecError, load_object

    for library, path in fixtures().values():
        if path == factory:
            return library
    loaded = load_object(factory)
    named = getattr(loaded, "library", None)
    if named is not None:
        if named not in adapters():
            raise SpecError(f"--spec {factory!r}: its library {named!r} must be one of {', '.join(adapters())}")
        return named
    claimed = [name for name, each in adapters().items() if each.claims(loaded)]
    if len(claimed) != 1:
        why = "none of the adapters claims it" if not claimed else f"{' and '.join(claimed)} all claim it"
        raise SpecError(f"--spec {factory!r}: {why}; give the spec a `library` attribute, one of "
                        f"{', '.join(adapters())}")
    return claimed[0]


def mixins() -> dict[str, str]:
    """Every adapter's pytest mixin names -> "module:attribute" (what `paracheck.testing` offers)."""
    return {name: path for each in adapters().values() for name, path in each.mixins().items()}


def select(models: str) -> list[tuple[str, str]]:
    """`--models` text -> (name, factory path) pairs in the order given: "all" (every installed adapter's
    fixtures), a library's name (its fixtures), a group an adapter names (`groups()`, e.g. diffusers' `pipelines`),
    or fixture names, comma separated. ValueError names the unknown
    ones and what there is, or the library a named fixture needs."""
    every = fixtures()
    groups = {"all": [n for n, (lib, _) in every.items() if adapter(lib).installed()]}
    groups.update({lib: [n for n, (owner, _) in every.items() if owner == lib] for lib in adapters()})
    for each in adapters().values():  # an adapter's own names for several of its fixtures (`Adapter.groups`)
        groups.update(each.groups())
    names = [n for m in models.split(",") for n in groups.get(m.strip(), [m.strip()])]
    unknown = [n for n in names if n not in every]
    if unknown:
        raise ValueError(f"{','.join(unknown)}: unknown; fixtures are {', '.join(every)} (or all, "
                         f"{', '.join(adapters())})")
    missing = sorted({every[n][0] for n in names if not adapter(every[n][0]).installed()})
    if missing:
        raise ValueError(f"{models}: the {', '.join(missing)} fixtures need {', '.join(missing)} installed "
                         f"(pip install 'paracheck[{missing[0]}]')")
    return [(n, every[n][1]) for n in names]
