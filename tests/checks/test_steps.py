"""parity.steps (the kit's optimizer loop, `checks.trainloop`) and diffusers' checkpoint.roundtrip: the loop's pure
parts in process, then real 2-rank gloo worlds: flux on tp2, u2 and r2 and the torch llama example on tp2 and fsdp2
step like one device, each new control is detected by parity.steps alone while every older check of its case
passes, and diffusers' save_pretrained after enable_parallelism round-trips under CP and is refused, in its words,
under TP."""

import copy

import pytest
import torch

from paracheck.checks import trainloop
from tests.support import run_paracheck

EXAMPLE = "examples/llama_tp_fsdp.py:spec"
#: Older checks: every check a case had before parity.steps and checkpoint.roundtrip.
NEW_CHECKS = {"parity.steps", "checkpoint.roundtrip"}
#: The errors measured on these cases (fp32 CPU, 3 steps, lr 1e-2): parameters within 2.3e-7 relative, losses within
#: 3e-5 absolute on losses of 100 to 330; bounds with room below the kit's tolerance (1e-5 + 1e-5 |ref|).
PARAM_REL = 1e-6


# -- the loop, in process ------------------------------------------------------------------------


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _loss(model, step):
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
    value = model(x).pow(2).sum()
    return value, value


def test_the_reference_sets_a_max_norm_that_clips_and_a_second_run_repeats_it_exactly():
    model = _model()
    expected = trainloop.train(copy.deepcopy(model), _loss, 3)
    assert expected.settings.max_norm == pytest.approx(trainloop.CLIP_FRACTION * expected.norms[0])
    count = sum(p.numel() for p in model.parameters())
    assert expected.settings.eps == pytest.approx(expected.settings.max_norm / count ** 0.5)
    assert trainloop.figures(expected, expected)["clipped"][0] and expected.clipped_by == "clip_grad_norm_"
    again = trainloop.train(copy.deepcopy(model), _loss, 3, expected.settings)
    for mine, ref in zip(again.records, expected.records):
        assert torch.equal(mine.loss, ref.loss) and all(torch.equal(mine.params[n], ref.params[n]) for n in ref.params)
    moved = expected.records[-1].params["0.weight"] - model[0].weight.detach()
    assert moved.abs().max() > 0 and all(p.grad is None for p in model.parameters())


def test_the_planted_bugs_change_the_steps_and_the_plain_hooks_do_not():
    model = _model()
    expected = trainloop.train(copy.deepcopy(model), _loss, 2)
    decayed = trainloop.train(copy.deepcopy(model), _loss, 2, expected.settings,
                              trainloop.Hooks(after_step=trainloop.decay_replicated_again))
    ratio = decayed.records[0].params["0.weight"] / expected.records[0].params["0.weight"]
    assert torch.allclose(ratio, torch.full_like(ratio, 1 - trainloop.LR * trainloop.WEIGHT_DECAY))
    # Plain tensors are whole on every rank, so their local norm is the whole one: the clip is unchanged.
    local = trainloop.train(copy.deepcopy(model), _loss, 2, expected.settings, trainloop.Hooks(clip=trainloop.clip_local_norm))
    assert torch.equal(local.records[-1].params["2.weight"], expected.records[-1].params["2.weight"])
    assert trainloop.replicated(torch.nn.Parameter(torch.ones(2)))


def test_a_training_control_is_refused_by_name_where_its_pass_is_not_taken():
    """The skeleton's rule, for every adapter: a control only parity.steps (or checkpoint.roundtrip) shows is a
    named skip where the case takes no fp32 step (or no save), not a miss."""
    from dataclasses import replace

    from paracheck.domain.case import Case
    from paracheck.adapters.diffusers.layout import DiffusersLayout
    from paracheck.rank.skeleton import _pass_off

    case = Case("flux", "f:m", DiffusersLayout.parse("tp2"), control="decay-twice", library="diffusers", steps=3)
    assert _pass_off(case) is None
    assert "(--steps 0;" in _pass_off(replace(case, steps=0))
    assert "a bf16 case does not take" in _pass_off(replace(case, dtype="bf16"))
    assert _pass_off(replace(case, control="backward-only", steps=0)) is None
    saved = Case("llama", "f:m", DiffusersLayout.parse("tp2"), control="tf-save-local-shard", library="transformers")
    assert "(--no-checkpoint;" in _pass_off(saved) and _pass_off(replace(saved, checkpoint=True)) is None


# -- real worlds ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def flux_run(tmp_path_factory):
    return run_paracheck(["--models", "flux", "--layouts", "tp2,u2,r2", "--nproc", "2", "--variants", "base",
                          "--controls", "--quiet"], tmp_path_factory.mktemp("flux_steps"))


@pytest.fixture(scope="module")
def torch_run(tmp_path_factory):
    return run_paracheck(["--spec", EXAMPLE, "--nproc", "2", "--layouts", "tp2,fsdp2", "--controls", "--quiet"],
                         tmp_path_factory.mktemp("torch_steps"))


def _checks(case) -> dict:
    return {c["id"]: c for c in case["checks"]}


def _steps_like_one_device(case) -> dict:
    steps = _checks(case)["parity.steps"]
    assert case["status"] == "pass" and steps["status"] == "pass" and steps["failed_ranks"] == [], case
    for rank, data in steps["data"]["per_rank"].items():
        assert len(data["steps"]) == 3 and all(s["max_rel"] < PARAM_REL for s in data["steps"]), (rank, data)
        assert data["clipped"][0] and data["norms"][0] > data["settings"]["max_norm"], data
        assert data["settings"]["weight_decay"] > 0
    return steps["data"]["per_rank"]["0"]


@pytest.mark.slow
def test_flux_steps_like_one_device_on_tp_ulysses_and_ring(flux_run):
    assert flux_run.code == 0, flux_run.out
    tp = _steps_like_one_device(flux_run.case("flux", "tp2"))
    # torch's clip_grad_norm_ refuses the mix of DTensor and plain gradients a diffusers TP model has.
    assert "clip_grad_norm_ refuses a mix" in tp["clipped_by"]
    assert any("TP-partial" in said for said in tp["user_reductions"])
    for layout in ("u2", "r2"):
        cp = _steps_like_one_device(flux_run.case("flux", layout))
        assert cp["clipped_by"] == "clip_grad_norm_" and "summed over the CP group" in cp["user_reductions"][0]


@pytest.mark.slow
def test_diffusers_save_pretrained_round_trips_under_cp_and_is_refused_under_tp(flux_run):
    for layout in ("u2", "r2"):
        saved = flux_run.check("flux", layout, "checkpoint.roundtrip")
        assert saved["status"] == "pass" and "tensors equal" in saved["detail"], saved
    refused = flux_run.check("flux", "tp2", "checkpoint.roundtrip")
    assert refused["status"] == "skip" and "NotImplementedError" in refused["detail"], refused
    assert "is sharded with tensor parallelism, so it cannot be saved yet" in refused["detail"]


def _detected_by_steps_alone(run, model, layout, control):
    case, plain = run.case(model, layout, control), run.case(model, layout)
    assert case["status"] == "detected", (layout, control, case["reason"])
    checks, before = _checks(case), _checks(plain)
    assert checks["parity.steps"]["status"] == "fail" and checks["parity.steps"]["failed_ranks"] == [0, 1]
    assert {k: v["status"] for k, v in checks.items() if k not in NEW_CHECKS} == \
        {k: "pass" for k in before if k not in NEW_CHECKS}, (layout, control)


@pytest.mark.slow
def test_each_new_diffusers_control_is_detected_by_steps_alone(flux_run):
    _detected_by_steps_alone(flux_run, "flux", "tp2", "clip-local-norm")
    for layout in ("tp2", "u2", "r2"):
        _detected_by_steps_alone(flux_run, "flux", layout, "decay-twice")
    assert "no tensor parallelism" in flux_run.case("flux", "u2", "clip-local-norm")["reason"]


@pytest.mark.slow
def test_the_torch_example_steps_like_one_device_and_its_new_controls_are_detected(torch_run):
    assert torch_run.code == 0, torch_run.out
    model = torch_run.report["cases"][0]["model"]
    for layout in ("tp2", "fsdp2"):
        assert _steps_like_one_device(torch_run.case(model, layout))["clipped_by"] == "clip_grad_norm_"
        _detected_by_steps_alone(torch_run, model, layout, "torch-clip-local-norm")
    _detected_by_steps_alone(torch_run, model, "tp2", "torch-decay-twice")
    assert "none is replicated on every rank" in torch_run.case(model, "fsdp2", "torch-decay-twice")["reason"]
