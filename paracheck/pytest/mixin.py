"""The pytest mixins' host: one launch per test class and world size, a test per (layout, variant) and check.

An adapter's mixin subclasses `ParallelTesterMixin` and says what differs between libraries: its layouts
(`_paracheck_layouts`, `_paracheck_layout`), the controls that apply to a layout (`_paracheck_applicable`) and the
cases one launch runs (`_paracheck_cases`). The host knows no library; `paracheck.testing` offers every adapter's
mixins by name. All cases of one class and world size run in one launch, the first test that needs them starts
it, and every test reads its own verdict; one fork server serves every launch of the session. Optional class
attributes: `paracheck_layouts`, `paracheck_backend`, `paracheck_atol`, `paracheck_rtol`, `paracheck_timeout`,
`paracheck_controls`, `paracheck_dtype`, `paracheck_variants`, `paracheck_known_failures`, `paracheck_steps`,
`paracheck_checkpoint`, `paracheck_generate`, `paracheck_localize`.
"""

from __future__ import annotations

import shutil
import tempfile

import pytest

from paracheck.domain import registry
from paracheck.domain.backends import missing_devices, resolve
from paracheck.domain.control import applicable_to
from paracheck.domain.records import CheckId

STRUCTURE_IDS = tuple(c for c in CheckId if c.structural)
_TRAINING = {CheckId.STEPS, CheckId.CHECKPOINT}

_RESULTS: dict[tuple, dict] = {}


class ParallelTesterMixin:
    paracheck_layouts: tuple[str, ...] = ()
    paracheck_backend: str | None = None
    paracheck_atol: float | None = None
    paracheck_rtol: float | None = None
    paracheck_timeout: float = 300.0
    paracheck_controls: bool = True
    paracheck_dtype: str = "fp32"
    #: Input variants by name (each adapter's mixin says which it makes inputs for).
    paracheck_variants: tuple[str, ...] = ("base",)
    #: A known-failures TOML path, "none", or None for the file paracheck ships.
    paracheck_known_failures: str | None = None
    #: Optimizer steps parity.steps takes on one layout of each kind of parallelism, and whether
    #: checkpoint.roundtrip runs there (`domain.tier.with_training`, as `paracheck run`'s default tier does). Off
    #: by default: a model's test class runs in its library's suite, and the steps and the save cost seconds per
    #: layout; `paracheck_steps = 3` turns them on (a training control is a named skip while they are off).
    paracheck_steps: int = 0
    paracheck_checkpoint: bool = False
    #: Whether parity.generate runs, on every layout (an adapter whose models generate turns it on in its mixin).
    paracheck_generate: bool = False
    #: Whether a failing case (a detected control included) is rerun with hooks to name the first module that
    #: differs, as `paracheck run` does (PARACHECK_LOCALIZE); False skips the rerun, about half a second a
    #: failing case; the gradient table, the check's own, stays.
    paracheck_localize: bool = True

    #: The structure checks a case of this mixin runs (its structure test reads these).
    paracheck_structure_ids = STRUCTURE_IDS

    #: The adapter whose grammar reads the layouts and whose controls apply (each adapter's mixin sets it).
    paracheck_library: str = ""

    # What differs between the libraries' mixins: the cases one launch runs; layouts where the defaults (the named
    # ones, read by the library's grammar) do not fit.
    @classmethod
    def _paracheck_layouts(cls) -> list:
        return [cls._paracheck_layout(name) for name in cls.paracheck_layouts]

    @classmethod
    def _paracheck_layout(cls, name: str):
        return registry.parse_layout(cls.paracheck_library, name)

    @classmethod
    def _paracheck_applicable(cls, layout) -> list[str]:
        return applicable_to(registry.controls(cls.paracheck_library), layout)

    @classmethod
    def _paracheck_refusal(cls, layout) -> str | None:
        """Why the class's model cannot take `layout` at all, known before any rank starts (None: it runs)."""
        return None

    def _paracheck_cases(self, layouts, folder: str) -> list:
        """This class's cases on `layouts`, whatever the ranks need written under `folder`."""
        raise NotImplementedError

    @pytest.mark.paracheck
    def test_paracheck_structure(self, paracheck_case, request):
        expect(self, request, paracheck_case, type(self).paracheck_structure_ids)

    @pytest.mark.paracheck
    def test_paracheck_forward(self, paracheck_case, request):
        expect(self, request, paracheck_case, (CheckId.FORWARD,))

    @pytest.mark.paracheck
    def test_paracheck_inference(self, paracheck_case, request):
        expect(self, request, paracheck_case, (CheckId.INFERENCE,))

    @pytest.mark.paracheck
    def test_paracheck_grads(self, paracheck_case, request):
        expect(self, request, paracheck_case, (CheckId.GRADS,))

    @pytest.mark.paracheck
    def test_paracheck_training(self, paracheck_case, request):
        expect(self, request, paracheck_case, (CheckId.STEPS, CheckId.CHECKPOINT))

    @pytest.mark.paracheck
    def test_paracheck_control(self, paracheck_control_case, request):
        expect(self, request, paracheck_control_case, ())


# -- collection ---------------------------------------------------------------------------------


def generate(metafunc) -> None:
    """Parametrize the mixin's tests over (layout, variant) and, for controls, the controls that apply."""
    cls = metafunc.cls
    if cls is None or not issubclass(cls, ParallelTesterMixin):
        return
    layouts = {layout.name: layout for layout in cls._paracheck_layouts()}
    variants = list(cls.paracheck_variants)
    plain = [(name, v, None) for name in layouts for v in variants]
    if "paracheck_control_case" in metafunc.fixturenames:
        cases = [(l, v, c) for l, v, _ in plain
                 for c in (cls._paracheck_applicable(layouts[l]) if cls.paracheck_controls else [])]
        params = cases or [pytest.param(None, marks=pytest.mark.skip(reason="no negative control applies here"))]
        metafunc.parametrize("paracheck_control_case", params, ids=[_id(c, variants) for c in cases] or ["no-control"])
    elif "paracheck_case" in metafunc.fixturenames:
        metafunc.parametrize("paracheck_case", plain, ids=[_id(c, variants) for c in plain])


def _id(case: tuple, variants: list[str]) -> str:
    layout, variant, control = case
    return "-".join([layout] + ([variant] if variants != ["base"] else []) + ([control] if control else []))


# -- running ------------------------------------------------------------------------------------


def _backend_name(test, request) -> str:
    return request.config.getoption("--paracheck-backend", default=None) or test.paracheck_backend or "auto"


def expect(test, request, case: tuple, check_ids) -> None:
    from paracheck.results.verdict import outcome_for_test

    layout_name, variant, control = case
    layout = type(test)._paracheck_layout(layout_name)
    backend = resolve(_backend_name(test, request))
    missing = missing_devices(backend, layout.world)
    if missing:
        pytest.skip(f"{layout}: {missing}")
    refused = type(test)._paracheck_refusal(layout)
    if refused:  # decided from the config alone: no rank starts for it
        pytest.skip(f"{layout}: {refused}")
    found = _results(test, backend, layout.world).get((layout.name, variant, control))
    if found is None:
        pytest.skip(f"the tester config has no inputs for variant {variant!r}: define "
                    "paracheck_variant_inputs(variant), or get_dummy_inputs(batch_size=...) for batch2")
    verdict, ranks = found
    if CheckId.GENERATE in check_ids and not verdict.case.generate:
        pytest.skip(f"{layout}: the class does not generate (paracheck_generate)")
    if set(check_ids) & _TRAINING and not (verdict.case.steps or verdict.case.checkpoint):
        pytest.skip(f"{layout}: the class takes the steps and the save on one layout of each kind of parallelism, "
                    "not this one (paracheck_steps, paracheck_checkpoint)")
    outcome, why = outcome_for_test(verdict, check_ids)
    replay = f"pytest '{request.node.nodeid}'" + (f" --paracheck-backend {backend.name}"
                                                 if backend.name != "gloo" else "")
    if outcome == "skip":
        pytest.skip(why)
    if outcome == "xfail":
        pytest.xfail(f"{why} [{verdict.known}]")
    if outcome == "fail":
        pytest.fail(_failure(verdict, ranks, why, replay), pytrace=False)


def _results(test, backend, world: int) -> dict:
    """Every case of this class and world size, launched once and cached for the session. Keyed by the class
    itself: a test file imported again (pytester, a rerun plugin) defines new classes, which launch again."""
    cls = type(test)
    key = (cls, backend.name, world)
    if key not in _RESULTS:
        _RESULTS[key] = _launch(test, backend, world)
    return _RESULTS[key]


def _launch(test, backend, world: int) -> dict:
    from paracheck.results import known
    from paracheck.launch.launcher import Launcher
    from paracheck.domain.tier import needs_generate, needs_training, training_parts, with_generate, with_training
    from paracheck.results.verdict import judge

    cls = type(test)
    layouts = [layout for layout in cls._paracheck_layouts() if layout.world == world]
    folder = tempfile.mkdtemp(prefix="paracheck-mixin-")
    try:
        cases = with_training(test._paracheck_cases(layouts, folder), cls.paracheck_steps, cls.paracheck_checkpoint,
                              needs=needs_training, parts=training_parts)
        if cls.paracheck_generate:
            cases = with_generate(cases, everything=True, needs=needs_generate)
        entries = known.load(cls.paracheck_known_failures or known.SHIPPED)
        switches = {} if cls.paracheck_localize else {"PARACHECK_LOCALIZE": "0"}
        outcome = Launcher(backend, world, cls.paracheck_timeout, known=known.as_data(entries),
                           switches=switches).run(cases)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    verdicts = judge(cases, [outcome.results[i] for i in range(len(cases))], entries)
    return {(v.case.layout.name, v.case.variant, v.case.control): (v, outcome.results[i])
            for i, v in enumerate(verdicts)}


def _failure(verdict, ranks, headline: str, replay: str) -> str:
    """The per-rank table for one case, with the command that replays it."""
    from paracheck.launch.attribution import ranks_named
    from paracheck.results.report import CELL

    shown = [c for c in CheckId if not c.simulated]
    c = verdict.case
    lines = [f"paracheck {c.model} {c.layout.name} route={verdict.route.value}"
             + (f" control={c.control}" if c.control else "") + f": {headline}",
             "rank  " + "  ".join(f"{i.short:6}" for i in shown) + "  fwd max_abs  status"]
    for rank in sorted(ranks, key=lambda r: r.rank):
        cells = [CELL[(rank.check(i).status if rank.check(i) else None)] for i in shown]
        fwd = rank.check(CheckId.FORWARD)
        figure = "" if fwd is None or fwd.max_abs is None else f"{fwd.max_abs:.1e}"
        lines.append(f"{rank.rank:<4}  " + "  ".join(f"{x:6}" for x in cells) + f"  {figure:11}  {rank.status.value}")
    for m in verdict.checks:
        if m.status.value == "fail":
            lines.append(f"{m.id.value} failed on {ranks_named(m.failed_ranks)}: rank {m.detail_rank}: {m.detail}")
    if verdict.traceback:
        lines.append(verdict.traceback.strip().splitlines()[-1])
    lines.append(f"replay: {replay}")
    return "\n".join(lines)
