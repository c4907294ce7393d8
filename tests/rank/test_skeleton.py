"""The one per-case skeleton every adapter's case runs through (`rank.skeleton`), on a real one-rank gloo world:
the pass order, the tolerance from the case's dtype and device with its overrides (0.0 included), a dtype the
adapter does not run refused by name, a raise typed, and a lost peer blamed only once collectives began."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from paracheck.checks.compare import tolerance
from paracheck.domain import registry
from paracheck.domain.adapter import Refused
from paracheck.domain.backends import get_backend
from paracheck.domain.case import Case
from paracheck.adapters.diffusers.layout import DiffusersLayout
from paracheck.domain.records import CheckId, CheckResult, RankStatus, Status
from paracheck.rank import skeleton
from paracheck.world.site import CaseSite

PASSES = ("reference", "parallelize", "structure_checks", "inference", "training", "forward_checks",
          "backward_skip", "backward", "grads_checks", "localize")


class _Toy:
    """An adapter whose body records what the skeleton calls, and raises where told."""
    name, dtypes = "toy", ("fp32",)

    def __init__(self, raise_in: str | None = None, error: Exception | None = None):
        self.calls, self.raise_in, self.error, self.ctx = [], raise_in, error, None

    def case_body(self, ctx):
        self.ctx = ctx
        toy = self

        class Body:
            def __getattr__(self, name):
                def step(*args):
                    toy.calls.append(name)
                    if name == toy.raise_in:
                        raise toy.error
                    if name.endswith("_checks") or name in ("steps", "checkpoint"):
                        return [CheckResult(CheckId.FORWARD, Status.PASS)] if name == "forward_checks" else []
                    return None
                return step

        return contextlib.nullcontext(Body())


@pytest.fixture
def world(one_rank_world, tmp_path):
    return CaseSite(0, str(tmp_path / "case"), str(tmp_path / "refs"), lambda key: True)


def _run(monkeypatch, toy, site, **fields):
    monkeypatch.setattr(registry, "adapter", lambda library: toy)
    os.makedirs(site.workdir, exist_ok=True)
    case = Case("m", "toy:factory", DiffusersLayout.parse("u2"), library="toy", **fields)
    return skeleton.run_case(case, get_backend("gloo"), site)


def test_the_passes_run_in_order_and_the_checks_are_kept(monkeypatch, world):
    toy = _Toy()
    result = _run(monkeypatch, toy, world)
    assert toy.calls == list(PASSES)
    assert result.status == RankStatus.OK and [c.id for c in result.checks] == [CheckId.FORWARD]
    assert {"reference", "parallel", "checks"} <= set(result.timings)


def test_steps_and_checkpoint_run_last_where_the_case_asks_and_a_body_without_them_says_so(monkeypatch, world):
    toy = _Toy()
    _run(monkeypatch, toy, world, steps=3, checkpoint=True)
    assert toy.calls == list(PASSES) + ["steps", "checkpoint"]

    class Plain(_Toy):
        def case_body(self, ctx):
            class Body:
                def __getattr__(self, name):
                    if name in ("steps", "checkpoint", "localize"):
                        raise AttributeError(name)
                    return lambda *args: [] if name.endswith("_checks") else None
            return contextlib.nullcontext(Body())

    result = _run(monkeypatch, Plain(), world, steps=3, checkpoint=True)
    assert [(c.id, c.status) for c in result.checks] == [(CheckId.STEPS, Status.SKIP),
                                                         (CheckId.CHECKPOINT, Status.SKIP)]
    assert "no parity.steps pass" in result.checks[0].detail


def test_the_bare_work_runs_the_model_calls_alone(monkeypatch, world):
    monkeypatch.setenv("PARACHECK_BARE", "1")
    toy = _Toy()
    result = _run(monkeypatch, toy, world, steps=3, checkpoint=True)
    assert toy.calls == ["reference", "parallelize", "inference", "training", "backward_skip", "backward"]
    assert result.status == RankStatus.OK and result.checks == []


def test_tolerance_comes_from_dtype_and_device_and_the_case_overrides_it_even_with_zero(monkeypatch, world):
    toy = _Toy()
    _run(monkeypatch, toy, world)
    assert (toy.ctx.tolerance.atol, toy.ctx.tolerance.rtol) == tolerance(torch.float32, "cpu")
    _run(monkeypatch, toy, world, atol=0.0, rtol=0.0)
    assert (toy.ctx.tolerance.atol, toy.ctx.tolerance.rtol) == (0.0, 0.0)
    case = Case("m", "f", DiffusersLayout.parse("u2"), library="toy")
    assert skeleton.case_tolerance(case, "cuda").atol == tolerance(torch.float32, "cuda")[0] != \
        skeleton.case_tolerance(case, "cpu").atol


def test_a_dtype_the_adapter_does_not_run_is_refused_by_name(monkeypatch, world):
    toy = _Toy()
    result = _run(monkeypatch, toy, world, dtype="bf16")
    assert result.status == RankStatus.SKIP and toy.calls == []
    assert result.reason == "--dtype bf16: the toy adapter runs fp32 only"


def test_a_refusal_is_a_skip_in_the_adapters_words(monkeypatch, world):
    result = _run(monkeypatch, _Toy("reference", Refused("the library refuses it")), world)
    assert result.status == RankStatus.SKIP and result.reason == "the library refuses it"
    assert not result.raised_in_parallel


@pytest.mark.parametrize("where,secondary", [("reference", False), ("training", True)])
def test_a_lost_peer_is_blamed_only_once_collectives_began(monkeypatch, world, where, secondary):
    result = _run(monkeypatch, _Toy(where, RuntimeError("Connection closed by peer")), world)
    assert result.status == RankStatus.ERROR and result.failure is not None
    assert result.secondary is secondary and result.raised_in_parallel is secondary
    assert "RuntimeError" in result.traceback


@pytest.mark.parametrize("where,named,check", [
    ("reference", "reference", None), ("parallelize", "parallelize", CheckId.MESH),
    ("inference", "inference", CheckId.INFERENCE), ("training", "forward", CheckId.FORWARD),
    ("backward", "backward", CheckId.GRADS), ("steps", "steps", CheckId.STEPS),
    ("checkpoint", "checkpoint", CheckId.CHECKPOINT), ("grads_checks", "gradient checks", None)])
def test_a_raise_names_its_pass_and_fails_that_passs_check_beside_the_checks_made(monkeypatch, world, where, named,
                                                                                  check):
    result = _run(monkeypatch, _Toy(where, NotImplementedError("no plan for Conv1d")), world, steps=3, checkpoint=True)
    assert result.status == RankStatus.ERROR
    assert result.reason == f"{named}: NotImplementedError: no plan for Conv1d"
    assert result.failure.check == check and result.failure.exception == "NotImplementedError"
    failing = [c for c in result.checks if c.status == Status.FAIL]
    assert [(c.id, c.detail) for c in failing] == ([(check, f"{named} raised NotImplementedError: no plan for "
                                                     "Conv1d")] if check else [])
    # The checks made before the raise are kept: the toy's forward check, made before the backward.
    after = where in ("backward", "grads_checks", "steps", "checkpoint")
    assert (CheckId.FORWARD in {c.id for c in result.checks if c.status == Status.PASS}) == after


def test_a_raise_a_pass_caught_itself_is_named_by_the_pass_its_check_belongs_to(monkeypatch, world):
    """A pass that runs its step through `ctx.attempt` (diffusers' forward, every adapter's steps) keeps going; the
    case's reason names the pass all the same."""
    class Attempting(_Toy):
        def case_body(self, ctx):
            class Body:
                def __getattr__(self, name):
                    if name == "training":
                        return lambda: ctx.attempt(lambda: 1 / 0, CheckId.FORWARD)
                    return lambda *args: [] if name.endswith("_checks") else None
            return contextlib.nullcontext(Body())

    result = _run(monkeypatch, Attempting(), world)
    assert result.status == RankStatus.ERROR and result.reason == "forward: ZeroDivisionError: division by zero"


def test_the_runs_dtype_reaches_every_adapters_cases():
    """`--dtype bf16` over every library: each adapter's cases carry it (one that runs fp32 only is then refused
    on its ranks by name, above), none silently runs fp32."""
    from paracheck.cli.main import build_cases, parser

    cases = build_cases(parser().parse_args(["run", "--dtype", "bf16", "--layouts", "tp2", "--nproc", "2"]),
                        get_backend("gloo"))
    assert {c.library for c in cases} >= {"diffusers", "transformers"}
    assert {c.dtype for c in cases} == {"bf16"}


@pytest.mark.slow
def test_a_transformers_case_honours_a_zero_tolerance(tmp_path):
    """A per-case atol/rtol of 0.0 is the tolerance, not "unset": a transformers case then fails on the ~1e-7 a
    parallel sum differs by, with the tolerance it was held to reported."""
    from paracheck.adapters.transformers.cases import factory_of
    from paracheck.launch.launcher import Launcher
    from paracheck.results.verdict import judge

    layout = registry.parse_layout("transformers", "tp2")
    case = Case("llama", factory_of("llama"), layout, route="sharded-load", library="transformers", atol=0.0, rtol=0.0)
    outcome = Launcher(get_backend("gloo"), 2, 600).run([case])
    [verdict] = judge([case], [outcome.results[0]], [])
    logits = verdict.check(CheckId.FORWARD)
    assert (logits.atol, logits.rtol) == (0.0, 0.0)
    assert logits.status == Status.FAIL and 0 < logits.max_abs < 1e-5


def test_a_spec_that_is_no_callable_is_still_claimed_by_its_adapter(tmp_path):
    """A torch spec may be any object with build/parallelize/inputs (docs/torch.md), a namespace included: the
    registry loads it as an object, and only a factory must be callable."""
    path = tmp_path / "namespace_spec.py"
    path.write_text("import types\nspec = types.SimpleNamespace(build=lambda: None, parallelize=lambda m, mesh, l: m,"
                    " inputs=lambda layout, variant: {})\n")
    assert registry.library_of(f"{path}:spec") == "torch"


def test_a_checkpoint_exception_is_the_cases_error_not_the_ranks_end(monkeypatch, world):
    """DCP's CheckpointException derives from BaseException only; a pass raising it still ends as the case's
    error, with the rank alive for the next case."""
    from torch.distributed.checkpoint.api import CheckpointException

    result = _run(monkeypatch, _Toy("checkpoint", CheckpointException("planted", {})), world, checkpoint=True)
    assert result.status == RankStatus.ERROR and "CheckpointException" in result.reason


def test_a_rank_whose_pass_raised_takes_no_steps_nor_save(monkeypatch, world):
    """Its peers may still be inside the pass that raised: a rank joining the steps' collectives would hang."""
    toy = _Toy()

    def attempted(ctx):
        ctx.attempt(lambda: (_ for _ in ()).throw(RuntimeError("planted")), CheckId.FORWARD)

    class Raising(_Toy):
        def case_body(self, ctx):
            body = toy.case_body(ctx).__enter__()
            original = body.training

            def training(*args):
                original()
                attempted(ctx)
            body.training = training
            return contextlib.nullcontext(body)

    result = _run(monkeypatch, Raising(), world, steps=3, checkpoint=True)
    assert "steps" not in toy.calls and "checkpoint" not in toy.calls
    assert [c.status for c in result.checks if c.id in (CheckId.STEPS, CheckId.CHECKPOINT)] == [Status.SKIP] * 2
