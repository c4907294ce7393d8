"""Pytest mixins: the whole kit by inheritance, in diffusers' tester-config convention.

    class TestFluxHybrid(FluxTransformerTesterConfig, HybridParallelTesterMixin):
        pass

The test class supplies `model_class`, `get_init_dict()` and `get_dummy_inputs(...)`. Each mixin
generates structure, forward, gradient and negative-control tests per layout (ids name the layout).
All cases of one class and world size run in one launch, the first test that needs them starts it,
and every test reads its own result. Optional class attributes: `paracheck_layouts`,
`paracheck_backend`, `paracheck_atol`, `paracheck_rtol`, `paracheck_timeout`, `paracheck_controls`.
"""

from __future__ import annotations

import inspect
import shutil
import tempfile

import pytest

from .backends import device_limit, resolve
from .case import expand
from .checks import CHECK_IDS
from .controls import applicable
from .layout import Layout

STRUCTURE = tuple(c for c in CHECK_IDS if c.startswith("structure."))
_RESULTS: dict[tuple, dict] = {}


class _ParallelTesterMixin:
    paracheck_layouts: tuple[str, ...] = ()
    paracheck_backend: str | None = None
    paracheck_atol: float | None = None
    paracheck_rtol: float | None = None
    paracheck_timeout: float = 300.0
    paracheck_controls: bool = True

    @pytest.mark.paracheck
    def test_paracheck_structure(self, paracheck_layout, request):
        _expect(self, request, paracheck_layout, None, STRUCTURE)

    @pytest.mark.paracheck
    def test_paracheck_forward(self, paracheck_layout, request):
        _expect(self, request, paracheck_layout, None, ("parity.forward",))

    @pytest.mark.paracheck
    def test_paracheck_grads(self, paracheck_layout, request):
        _expect(self, request, paracheck_layout, None, ("parity.grads",))

    @pytest.mark.paracheck
    def test_paracheck_control(self, paracheck_layout, paracheck_control, request):
        _expect(self, request, paracheck_layout, paracheck_control, ())


class HybridParallelTesterMixin(_ParallelTesterMixin):
    """TP x Ulysses on one shared mesh (the composed route where the library refuses both)."""
    paracheck_layouts = ("tp2xu2",)


class TensorParallelTesterMixin(_ParallelTesterMixin):
    paracheck_layouts = ("tp2", "tp4")


class ContextParallelTesterMixin(_ParallelTesterMixin):
    paracheck_layouts = ("u2", "u4", "r2", "r4")


# -- collection ---------------------------------------------------------------------------------


def generate(metafunc) -> None:
    """Parametrize the mixin's tests over the class's layouts (and controls that apply to them)."""
    cls = metafunc.cls
    if cls is None or not issubclass(cls, _ParallelTesterMixin):
        return
    layouts = [Layout.parse(name) for name in cls.paracheck_layouts]
    if "paracheck_control" in metafunc.fixturenames:
        pairs = [(l.name, c) for l in layouts for c in (applicable(l) if cls.paracheck_controls else [])]
        metafunc.parametrize("paracheck_layout,paracheck_control", pairs or [pytest.param(None, None, marks=pytest.mark.skip(
            reason="no negative control applies to these layouts"))], ids=[f"{l}-{c}" for l, c in pairs] or None)
    elif "paracheck_layout" in metafunc.fixturenames:
        metafunc.parametrize("paracheck_layout", [l.name for l in layouts], ids=[l.name for l in layouts])


# -- running ------------------------------------------------------------------------------------


def _backend_name(test, request) -> str:
    return request.config.getoption("--paracheck-backend", default=None) or test.paracheck_backend or "auto"


def _expect(test, request, layout_name: str, control: str | None, check_ids: tuple[str, ...]) -> None:
    layout = Layout.parse(layout_name)
    backend = resolve(_backend_name(test, request))
    limit = device_limit(backend)
    if limit is not None and layout.world > limit:
        pytest.skip(f"{layout} needs {layout.world} {backend.name} devices, this machine has {limit}")
    entry, ranks = _results(test, backend, layout.world)[(layout.name, control)]
    replay = f"pytest '{request.node.nodeid}'" + (f" --paracheck-backend {backend.name}"
                                                 if backend.name != "gloo" else "")
    if entry["status"] == "skip":
        pytest.skip(entry["reason"])
    if control:
        if entry["status"] != "detected":
            pytest.fail(_failure(entry, ranks, f"control {control} was {entry['status']}: {entry['reason']}", replay),
                        pytrace=False)
        return
    if entry["status"] == "error" and not entry["checks"]:
        pytest.fail(_failure(entry, ranks, f"the case raised: {entry['reason']}", replay), pytrace=False)
    checks = {c["id"]: c for c in entry["checks"]}
    missing = [cid for cid in check_ids if cid not in checks]
    if missing:
        pytest.fail(_failure(entry, ranks, f"{', '.join(missing)} never ran", replay), pytrace=False)
    failing = [cid for cid in check_ids if checks[cid]["status"] == "fail"]
    if failing:
        pytest.fail(_failure(entry, ranks, f"{', '.join(failing)} failed", replay), pytrace=False)
    if all(checks[cid]["status"] == "skip" for cid in check_ids):
        pytest.skip("; ".join(checks[cid]["detail"] for cid in check_ids))


def _results(test, backend, world: int) -> dict:
    """Every case of this class and world size, launched once and cached for the session."""
    cls = type(test)
    key = (cls.__module__, cls.__qualname__, backend.name, world)
    if key not in _RESULTS:
        _RESULTS[key] = _launch(test, backend, world)
    return _RESULTS[key]


def _launch(test, backend, world: int) -> dict:
    from . import report
    from .launch import Launcher
    from .payload import dump

    cls = type(test)
    layouts = [Layout.parse(n) for n in cls.paracheck_layouts if Layout.parse(n).world == world]
    folder = tempfile.mkdtemp(prefix="paracheck-mixin-")
    try:
        payload = dump(folder, test.model_class, test.get_init_dict(), _dummy_inputs(test))
        controls = applicable if cls.paracheck_controls else (lambda layout: [])
        cases = expand(cls.__name__, "payload", layouts, controls, payload=payload, atol=cls.paracheck_atol,
                       rtol=cls.paracheck_rtol)
        outcome = Launcher(backend, world, cls.paracheck_timeout).run(cases)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {(c.layout.name, c.control): (report.merge_case(c, outcome.results[i]), outcome.results[i])
            for i, c in enumerate(cases)}


def _dummy_inputs(test) -> dict:
    method = test.get_dummy_inputs
    parameters = inspect.signature(method).parameters
    kwargs = {}
    if "batch_size" in parameters:
        kwargs["batch_size"] = 1
    if "device" in parameters:
        kwargs["device"] = "cpu"
    return method(**kwargs)


def _failure(entry: dict, ranks: list[dict], headline: str, replay: str) -> str:
    """The per-rank table for one case, with the command that replays it."""
    from .report import CELL, SHORT_NAMES as short, ranks_text

    lines = [f"paracheck {entry['model']} {entry['layout']} route={entry['route']}"
             + (f" control={entry['control']}" if entry["control"] else "") + f": {headline}",
             "rank  " + "  ".join(f"{s:6}" for s in short.values()) + "  fwd max_abs  status"]
    for rank in sorted(ranks, key=lambda r: r["rank"]):
        checks = {c["id"]: c for c in rank.get("checks", [])}
        cells = [CELL[checks.get(cid, {}).get("status")] for cid in short]
        fwd = checks.get("parity.forward", {}).get("max_abs")
        lines.append(f"{rank['rank']:<4}  " + "  ".join(f"{c:6}" for c in cells)
                     + f"  {'' if fwd is None else f'{fwd:.1e}':11}  {rank['status']}")
    for check in entry["checks"]:
        if check["status"] == "fail":
            lines.append(f"{check['id']} failed on ranks {ranks_text(check['failed_ranks'])}: {check['detail']}")
    if entry.get("traceback"):
        lines.append(entry["traceback"].strip().splitlines()[-1])
    lines.append(f"replay: {replay}")
    return "\n".join(lines)
