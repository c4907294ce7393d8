"""Every adapter's bundled fixtures by name: what `--models` selects, and which library each belongs to."""

from paracheck.adapters.diffusers.fixtures_index import FIXTURES


def select(models: str) -> list[tuple[str, str]]:
    """`--models` text -> (name, factory path) pairs in the order given: "all" (every library's fixtures,
    the transformers ones where transformers is installed), "diffusers", "transformers", or names, comma
    separated. ValueError names the unknown ones and the fixtures there are."""
    known = {**FIXTURES, **TRANSFORMERS_FIXTURES}
    every = list(FIXTURES) + (list(TRANSFORMERS_FIXTURES) if transformers_installed() else [])
    groups = {"all": every, "diffusers": list(FIXTURES), "transformers": list(TRANSFORMERS_FIXTURES)}
    names = [n for m in models.split(",") for n in groups.get(m.strip(), [m.strip()])]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"{','.join(unknown)}: unknown; fixtures are {', '.join(known)} (or all, diffusers, transformers)")
    if any(n in TRANSFORMERS_FIXTURES for n in names) and not transformers_installed():
        raise ValueError(f"{models}: the transformers fixtures need transformers (pip install 'paracheck[transformers]')")
    return [(n, known[n]) for n in names]


def _transformers_fixtures() -> dict[str, str]:
    from paracheck.adapters.transformers.cases import FACTORY_PREFIX
    from paracheck.adapters.transformers.fixtures import FIXTURES as NAMES

    return {name: FACTORY_PREFIX + name for name in NAMES}


#: The transformers adapter's fixtures (`paracheck.adapters.transformers.fixtures`), by name.
TRANSFORMERS_FIXTURES = _transformers_fixtures()


def library_of(factory: str) -> str:
    """Whose model a factory builds: "transformers" for the adapter's fixtures and for a `--spec` factory that
    says so with a `library` attribute (a found transformers case's spec), else "diffusers"."""
    if factory in TRANSFORMERS_FIXTURES.values():
        return "transformers"
    if factory in FIXTURES.values():
        return "diffusers"
    from paracheck.adapters import LIBRARIES
    from paracheck.domain.case import SpecError, load_factory

    library = getattr(load_factory(factory), "library", "diffusers")
    if library not in LIBRARIES:
        raise SpecError(f"--spec {factory!r}: its library {library!r} must be one of {', '.join(LIBRARIES)}")
    return library


def transformers_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers") is not None
