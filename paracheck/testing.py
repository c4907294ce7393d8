"""Pytest mixins: the whole kit by inheritance, in diffusers' tester-config convention.

    class TestFluxHybrid(FluxTransformerTesterConfig, HybridParallelTesterMixin):
        pass

The test class supplies `model_class` (an attribute or a property), `get_init_dict()` and
`get_dummy_inputs(...)` (given `batch_size=1` and `device="cpu"` where it takes them). Each mixin
generates structure, forward, inference (the no-grad forward), gradient and negative-control tests per
layout (ids name the layout).
All cases of one class and world size run in one launch, the first test that needs them starts it,
and every test reads its own verdict; one fork server serves every launch of the session. Optional
class attributes: `paracheck_layouts`, `paracheck_backend`, `paracheck_atol`, `paracheck_rtol`,
`paracheck_timeout`, `paracheck_controls`, `paracheck_dtype`, `paracheck_variants`,
`paracheck_known_failures`, `paracheck_attention_backend`.

`CausalLMParallelTesterMixin` does the same for a transformers causal LM given by its tester's tiny config
(`get_config()`), over the `DistributedConfig` layouts its plans allow (see `paracheck.pytest.causal_lm`).
"""

from __future__ import annotations

import inspect
import shutil
import tempfile

import pytest

from paracheck.adapters.transformers.controls import applicable as tf_applicable
from paracheck.adapters.transformers.layout import TfLayout
from paracheck.domain.backends import missing_devices, resolve
from paracheck.domain.case import expand
from paracheck.adapters.diffusers.controls import applicable
from paracheck.domain.layout import Layout
from paracheck.domain.records import CheckId

STRUCTURE_IDS = tuple(c for c in CheckId if c.structural)

_RESULTS: dict[tuple, dict] = {}


class _ParallelTesterMixin:
    paracheck_layouts: tuple[str, ...] = ()
    paracheck_backend: str | None = None
    paracheck_atol: float | None = None
    paracheck_rtol: float | None = None
    paracheck_timeout: float = 300.0
    paracheck_controls: bool = True
    paracheck_dtype: str = "fp32"
    #: Input variants: "base" (batch_size=1), "batch2" (batch_size=2); others come from the class's
    #: `paracheck_variant_inputs(variant)` when it defines one.
    paracheck_variants: tuple[str, ...] = ("base",)
    #: A known-failures TOML path, "none", or None for the file paracheck ships.
    paracheck_known_failures: str | None = None
    #: "auto" or a diffusers attention backend name (see `paracheck.adapters.diffusers.attention.choose`).
    paracheck_attention_backend: str = "auto"

    #: The structure checks a case of this mixin runs (its structure test reads these).
    paracheck_structure_ids = STRUCTURE_IDS

    # What differs between the libraries' mixins: layouts, controls, and the cases one launch runs.
    @classmethod
    def _paracheck_layouts(cls) -> list:
        return [Layout.parse(name) for name in cls.paracheck_layouts]

    @classmethod
    def _paracheck_layout(cls, name: str):
        return Layout.parse(name)

    @classmethod
    def _paracheck_applicable(cls, layout) -> list[str]:
        return applicable(layout)

    @classmethod
    def _paracheck_refusal(cls, layout) -> str | None:
        """Why the class's model cannot take `layout` at all, known before any rank starts (None: it runs)."""
        return None

    def _paracheck_cases(self, layouts, folder: str) -> list:
        """This class's cases on `layouts`, their models and inputs written under `folder` for the ranks."""
        from paracheck.adapters.diffusers.library import unsupported

        problem = unsupported()
        if problem:
            pytest.fail(f"paracheck: {problem}", pytrace=False)
        cls = type(self)
        variants = [v for v in cls.paracheck_variants if _dump_variant(self, folder, v)]
        controls = applicable if cls.paracheck_controls else (lambda layout: [])
        return expand(cls.__name__, "payload", layouts, controls, variants=variants, payload=folder,
                      atol=cls.paracheck_atol, rtol=cls.paracheck_rtol, dtype=cls.paracheck_dtype,
                      attention_backend=cls.paracheck_attention_backend)

    @pytest.mark.paracheck
    def test_paracheck_structure(self, paracheck_case, request):
        _expect(self, request, paracheck_case, type(self).paracheck_structure_ids)

    @pytest.mark.paracheck
    def test_paracheck_forward(self, paracheck_case, request):
        _expect(self, request, paracheck_case, (CheckId.FORWARD,))

    @pytest.mark.paracheck
    def test_paracheck_inference(self, paracheck_case, request):
        _expect(self, request, paracheck_case, (CheckId.INFERENCE,))

    @pytest.mark.paracheck
    def test_paracheck_grads(self, paracheck_case, request):
        _expect(self, request, paracheck_case, (CheckId.GRADS,))

    @pytest.mark.paracheck
    def test_paracheck_control(self, paracheck_control_case, request):
        _expect(self, request, paracheck_control_case, ())


class HybridParallelTesterMixin(_ParallelTesterMixin):
    """TP x Ulysses on one shared mesh (the composed route where the library refuses both)."""
    paracheck_layouts = ("tp2xu2",)


class TensorParallelTesterMixin(_ParallelTesterMixin):
    paracheck_layouts = ("tp2", "tp4")


class ContextParallelTesterMixin(_ParallelTesterMixin):
    paracheck_layouts = ("u2", "u4", "r2", "r4")


class CausalLMParallelTesterMixin(_ParallelTesterMixin):
    """A transformers causal LM from its tester's tiny config: `get_config()` returns the `PretrainedConfig`,
    `model_class` (optional) the class to build; loaded with `from_pretrained(distributed_config=...)` on
    every layout of `paracheck_world` ranks its plans allow (`paracheck_layouts = None`), or those named."""
    paracheck_layouts: tuple[str, ...] | None = None
    paracheck_world: int = 4
    model_class = None
    paracheck_structure_ids = (CheckId.MESH, CheckId.TP_SHARDS)

    @classmethod
    def _paracheck_layouts(cls) -> list:
        from paracheck.pytest.causal_lm import plan_layouts

        if cls.paracheck_layouts is None:
            return plan_layouts(cls().get_config(), cls.paracheck_world)
        return [TfLayout.parse(name) for name in cls.paracheck_layouts]

    @classmethod
    def _paracheck_layout(cls, name: str):
        return TfLayout.parse(name)

    @classmethod
    def _paracheck_applicable(cls, layout) -> list[str]:
        return tf_applicable(layout)

    @classmethod
    def _paracheck_refusal(cls, layout) -> str | None:
        from paracheck.pytest.causal_lm import refusal

        return refusal(cls().get_config(), layout, cls.paracheck_dtype)

    def _paracheck_cases(self, layouts, folder: str) -> list:
        from paracheck.pytest.causal_lm import cases, check_variants, write_checkpoint

        cls = type(self)
        if cls.paracheck_dtype != "fp32":
            raise ValueError(f"paracheck_dtype {cls.paracheck_dtype!r}: the transformers adapter runs fp32 only")
        layouts = [layout for layout in layouts if not cls._paracheck_refusal(layout)]
        path = write_checkpoint(self.get_config(), cls.model_class, folder)
        return cases(cls.__name__, path, layouts, check_variants(cls.paracheck_variants), cls.paracheck_controls,
                     cls.paracheck_atol, cls.paracheck_rtol)

    @pytest.mark.paracheck
    def test_paracheck_loss(self, paracheck_case, request):
        _expect(self, request, paracheck_case, (CheckId.LOSS,))


# -- collection ---------------------------------------------------------------------------------


def generate(metafunc) -> None:
    """Parametrize the mixin's tests over (layout, variant) and, for controls, the controls that apply."""
    cls = metafunc.cls
    if cls is None or not issubclass(cls, _ParallelTesterMixin):
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


def _expect(test, request, case: tuple, check_ids) -> None:
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
    from paracheck.results.verdict import judge

    cls = type(test)
    layouts = [layout for layout in cls._paracheck_layouts() if layout.world == world]
    folder = tempfile.mkdtemp(prefix="paracheck-mixin-")
    try:
        cases = test._paracheck_cases(layouts, folder)
        outcome = Launcher(backend, world, cls.paracheck_timeout).run(cases)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    verdicts = judge(cases, [outcome.results[i] for i in range(len(cases))],
                     known.load(cls.paracheck_known_failures or known.SHIPPED))
    return {(v.case.layout.name, v.case.variant, v.case.control): (v, outcome.results[i])
            for i, v in enumerate(verdicts)}


def _dump_variant(test, folder: str, variant: str) -> bool:
    """Write the variant's model and inputs for the ranks; False when the class cannot make them."""
    import os

    from paracheck.pytest.payload import dump

    inputs = _variant_inputs(test, variant)
    if inputs is None:
        return False
    dump(os.path.join(folder, variant), test.model_class, test.get_init_dict(), inputs)
    return True


def _variant_inputs(test, variant: str):
    custom = getattr(test, "paracheck_variant_inputs", None)
    if custom is not None and variant not in ("base", "batch2"):
        return custom(variant)
    method = test.get_dummy_inputs
    parameters = inspect.signature(method).parameters
    kwargs = {"device": "cpu"} if "device" in parameters else {}
    if "batch_size" in parameters:
        kwargs["batch_size"] = 2 if variant == "batch2" else 1
    elif variant == "batch2":
        return custom(variant) if custom else None
    return method(**kwargs) if variant in ("base", "batch2") else None


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
