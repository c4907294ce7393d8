"""Cases: one model on one layout through one route, optionally with one planted bug.

A case crosses from the launcher to the ranks as JSON, so it names its model factory by import path
(`module:function`) rather than carrying objects.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import asdict, dataclass, replace

from paracheck.domain.layout import Layout
from paracheck.domain.records import Route
from paracheck.domain.shapes import Shape

ROUTES = tuple(r.value for r in Route)
DTYPES = ("fp32", "bf16", "fp16")


class SpecError(ValueError):
    """A `--spec` that does not import, or whose factory returns the wrong shape."""


class FixtureUnavailable(Exception):
    """A bundled fixture whose model class the installed library lacks: a skip with this reason, never an error."""


@dataclass(frozen=True)
class Case:
    model: str
    factory: str
    layout: Layout
    route: Route = Route.AUTO
    control: str | None = None
    grads: bool = True
    variant: str = "base"
    dtype: str = "fp32"
    #: The library's context-parallel options for this case, e.g. (("ulysses_anything", True),).
    cp_options: tuple = ()
    #: The attention backend asked for: "auto" or a name (see `attention.choose`).
    attention_backend: str = "auto"
    #: The inputs' shape, where it is not the variant's own (`paracheck explore` draws it); the factory must
    #: take `shape=` then (the fixtures do).
    shape: Shape | None = None
    #: Set by the pytest mixins: a directory holding the init dict and inputs (see `payload`).
    payload: str | None = None
    #: Tolerances that override the ones from dtype and backend (the mixins' class attributes).
    atol: float | None = None
    rtol: float | None = None
    #: Whose model this is: an adapter's name (`domain.registry`), whose grammar reads `layout`. Required.
    library: str = ""
    #: Optimizer steps `parity.steps` takes after the backward (0: none); `checkpoint.roundtrip` runs when set.
    #: The host turns them on (`domain.tier.with_training`); a body skips what its model cannot do, by name.
    steps: int = 0
    checkpoint: bool = False
    #: `parity.generate` runs when set (the host turns it on: `domain.tier.with_generate`).
    generate: bool = False

    def __post_init__(self):
        if not self.library:
            raise ValueError(f"case {self.model!r}: `library` must name the adapter whose model it is")
        object.__setattr__(self, "route", Route(self.route))
        object.__setattr__(self, "cp_options", tuple(tuple(o) for o in self.cp_options))
        if isinstance(self.shape, dict):
            object.__setattr__(self, "shape", Shape.from_json(self.shape))

    def id_with(self, route: Route | None = None) -> str:
        """`model-layout-route[-variant][-control]`; `route` is the resolved one once a rank knows it."""
        parts = [self.model, self.layout.name, (route or self.route).value]
        if self.variant != "base":
            parts.append(self.variant)
        if self.control:
            parts.append(self.control)
        return "-".join(parts)

    @property
    def id(self) -> str:
        return self.id_with()

    @property
    def plain(self) -> "Case":
        """The same case without its planted bug: what a control is judged against (controls always run
        gradients, and take the steps, the save and generation only where their bug shows there, so the plain case is
        matched whatever its `grads`, `steps`, `checkpoint` and `generate`)."""
        return replace(self, control=None, grads=True, steps=0, checkpoint=False, generate=False)

    def to_json(self) -> dict:
        data = asdict(self)
        data["route"] = self.route.value
        data["layout"] = {"name": self.layout.name, "order": self.layout.order}
        data["shape"] = self.shape.to_json() if self.shape else None
        return data

    @classmethod
    def from_json(cls, data: dict, parse_layout) -> "Case":
        """`parse_layout(library, name, order)` reads the layout in its library's grammar (the registry's,
        `domain.registry.parse_layout`)."""
        data = dict(data)
        layout = data.pop("layout")
        return cls(layout=parse_layout(data["library"], layout["name"], layout["order"]), **data)


def options_text(cp_options) -> str:
    """((name, value), ...) -> `name=value,...`, sorted: what `parse_cp_options` reads back."""
    return ",".join(f"{k}={v}" for k, v in sorted(cp_options))


def load_object(path: str, example: str = "my_tests.specs:make_flux"):
    """The object `module:name` names; a module may also be a file path (`tests/my_spec.py:make`). SpecError
    names what failed."""
    module_name, sep, name = path.rpartition(":")
    if not sep or not module_name or not name:
        raise SpecError(f"--spec {path!r}: write MODULE:FUNCTION (or MODULE:NAME of a spec object), e.g. {example}")
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            module = _import_file(module_name)
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except SpecError:
        raise
    except Exception as exc:  # the user's module may raise anything while importing
        raise SpecError(f"--spec {path!r}: importing {module_name!r} failed: {type(exc).__name__}: {exc}") from exc
    if not hasattr(module, name):
        raise SpecError(f"--spec {path!r}: {module_name!r} has no callable {name!r} (nor any object of that name)")
    return getattr(module, name)


def load_factory(path: str):
    """Import `module:function` and check it can be called (`load_object`)."""
    factory = load_object(path)
    if not callable(factory):
        raise SpecError(f"--spec {path!r}: {path.rpartition(':')[0]!r} has no callable {path.rpartition(':')[2]!r}")
    return factory


def factory_variants(path: str) -> tuple[str, ...]:
    """The input variants a factory offers: its `variants` attribute, else only "base"."""
    return tuple(getattr(load_factory(path), "variants", ("base",)))


def call_factory(path: str, variant: str = "base", shape: Shape | None = None):
    """Run a factory (for `variant`, if not base; with `shape=`, if given) and check it returns
    `(model_class, init_dict, inputs)`."""
    try:
        factory = load_factory(path)
        kwargs = {}
        if variant != "base":
            kwargs["variant"] = variant
        if shape:
            kwargs["shape"] = shape
        result = factory(**kwargs)
    except (SpecError, FixtureUnavailable):
        raise
    except Exception as exc:
        raise SpecError(f"--spec {path!r}: calling the factory raised {type(exc).__name__}: {exc}") from exc
    if not (isinstance(result, tuple) and len(result) == 3):
        raise SpecError(
            f"--spec {path!r}: the factory must return (model_class, init_dict, inputs), got {_shape(result)}"
        )
    model_class, init_dict, inputs = result
    if not isinstance(model_class, type):
        raise SpecError(f"--spec {path!r}: model_class must be a class, got {type(model_class).__name__}")
    if not isinstance(init_dict, dict) or not isinstance(inputs, dict):
        raise SpecError(
            f"--spec {path!r}: init_dict and inputs must be dicts, got "
            f"{type(init_dict).__name__} and {type(inputs).__name__}"
        )
    return model_class, init_dict, inputs


def _import_file(path: str):
    """The module at `path`, run once per process as an import would be: explore calls a factory per
    draw, and a spec's own caches (a class built once) must survive between calls."""
    if not os.path.exists(path):
        raise SpecError(f"--spec: file {path!r} does not exist")
    where = os.path.abspath(path)
    if where not in _FILES:
        name = "paracheck_spec_" + os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        _FILES[where] = module
    return _FILES[where]


_FILES: dict = {}  # absolute path -> module


def _shape(value) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)}"
    return type(value).__name__
