"""Localization proven on the controls, on real gloo ranks: every control that breaks the forward or the
gradients is localized to the place it declares (`Control.plants_in`), and the report says where."""

import pytest

from paracheck.domain.registry import get_control
from tests.support import run_paracheck


def _planted_cases(run):
    """The detected control cases whose control declares where it plants."""
    return [c for c in run.report["cases"] if c["control"] and get_control(c["control"]).plants_in
            and c["status"] == "detected"]


def _share(cases) -> tuple[int, int, list]:
    missed = [(c["model"], c["layout"], c["control"], (c.get("localization", {}).get("planted") or {}).get("named"))
              for c in cases if not (c.get("localization", {}).get("planted") or {}).get("localized")]
    return len(cases) - len(missed), len(cases), missed


@pytest.mark.slow
def test_every_diffusers_control_is_localized_where_it_plants(tmp_path):
    """One launch on tp2xr2 plants every diffusers control that breaks the numbers (9 of them: the forward's,
    the no-grad pass's, the gradients', and skip-cp-hooks, whose gradients are summed over a CP group that
    never split the work)."""
    run = run_paracheck(["--models", "flux", "--layouts", "tp2xr2", "--variants", "base", "--controls"], tmp_path)
    assert run.code == 0, run.out
    cases = _planted_cases(run)
    assert {c["control"] for c in cases} == {
        "skip-cp-hooks", "skip-processor-config", "skip-output-gather", "global-rank-shard-index", "backward-only",
        "ring-stale-kv-backward", "ring-drop-merge", "cp-attention-local", "inference-attention-local"}
    localized, total, missed = _share(cases)
    assert localized == total, missed
    by_control = {c["control"]: c["localization"] for c in cases}
    # What each names, as a person reads it: the forward's origin, the gradients' pattern and origin.
    assert by_control["skip-output-gather"]["forward"]["origin"] == "proj_out"
    assert by_control["skip-processor-config"]["forward"]["origin"] == "transformer_blocks.0.attn"
    assert by_control["skip-processor-config"]["forward"]["first"]["module"] == "transformer_blocks.0.attn.to_out.0"
    assert by_control["inference-attention-local"]["forward"]["pass"] == "no_grad"
    assert by_control["backward-only"]["grads"]["pattern"] == "every gradient off by 1.5"
    assert by_control["skip-cp-hooks"]["grads"]["pattern"].startswith("every gradient off by 2 = tp = cp")
    assert by_control["ring-stale-kv-backward"]["grads"]["origin_from"] == "backward trace"
    for found in by_control.values():
        assert set(found["planted"]) == {"plants_in", "named", "from", "localized"}
        for part in ("forward", "grads"):
            if part in found:
                assert found[part]["ranks"] == [0, 1, 2, 3]  # every rank found the same


@pytest.mark.slow
def test_a_failing_case_says_where_in_its_note_and_its_json(tmp_path):
    """A plain case made to fail (a spec whose native backend drops the CP config): the note names the first
    module beyond tolerance, where it arises and the last that agreed; the JSON has the whole trace."""
    from tests.support import SPECS

    run = run_paracheck(["--spec", f"{SPECS}:flux_native_ignores_cp", "--layouts", "u4", "--variants", "base"],
                        tmp_path)
    assert run.code == 1
    case = run.report["cases"][0]
    forward = case["localization"]["forward"]
    assert forward["origin"] == "transformer_blocks.0.attn" and forward["reproduced"]
    assert forward["last_agreeing"]["module"] and forward["not_compared"] == []
    assert [m["module"] for m in forward["modules"]][-1] == "<root>"
    assert "first module beyond tolerance: transformer_blocks.0.attn.to_out.0" in run.out
    assert "arising in transformer_blocks.0.attn (its inputs agree); last agreeing: " in run.out
    assert "grads on ranks 0,1,2,3: " in run.out
    # The grads message says which measure names which parameter.
    grads = next(c for c in case["checks"] if c["id"] == "parity.grads")
    assert "grads beyond tolerance: " in grads["detail"] and "largest max_abs: " in grads["detail"]
    assert "localization" not in str(grads["data"])  # the case carries it once, merged


@pytest.mark.slow
def test_every_transformers_control_is_localized_where_it_plants(tmp_path):
    run = run_paracheck(["--models", "qwen3", "--layouts", "tp2xfsdp2", "--variants", "base", "--controls", "--steps",
                         "0", "--no-checkpoint"], tmp_path)  # the forward and gradient controls: no training
    assert run.code == 0, run.out
    cases = _planted_cases(run)
    assert {c["control"] for c in cases} == {"tf-norm-replicate", "tf-skip-dp-reduce", "tf-grad-divide",
                                             "tf-cache-all-heads", "tf-position-stuck"}  # the last two: generate
    localized, total, missed = _share(cases)
    assert localized == total, missed
    norms = next(c for c in cases if c["control"] == "tf-norm-replicate")["localization"]["grads"]
    assert norms["pattern"].endswith("everything else exact")
    off = [p["param"] for p in norms["params"] if not p["within"]]
    assert off and all(get_control("tf-norm-replicate").planted_at(p) for p in off)
    divide = next(c for c in cases if c["control"] == "tf-grad-divide")["localization"]["grads"]
    assert divide["pattern"].startswith("every gradient off by 0.5 = 1/")


class _LtxTesterConfig:
    """diffusers' own LTX tester config (as tests/pytest/test_mixins.py writes it)."""

    @property
    def model_class(self):
        from diffusers import LTXVideoTransformer3DModel

        return LTXVideoTransformer3DModel

    def get_init_dict(self):
        return dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
                    num_layers=1, qk_norm="rms_norm_across_heads", caption_channels=16)

    def get_dummy_inputs(self):
        import torch

        g = torch.Generator().manual_seed(0)
        return dict(hidden_states=torch.randn(2, 2 * 16 * 16, 4, generator=g),
                    encoder_hidden_states=torch.randn(2, 16, 16, generator=g),
                    timestep=torch.randint(0, 1000, (2,), generator=g),
                    encoder_attention_mask=torch.ones(2, 16).bool(), num_frames=2, height=16, width=16)


@pytest.mark.slow
def test_a_rounding_disagreement_is_judged_against_fp64():
    """At half the tolerance, LTX's r2 gradients of proj_in/proj_out disagree with the single-device ones beyond
    the elementwise bound (long cancelling sums); against fp64 they are no worse than the single device's own,
    so parity.grads passes and says why. The same config's controls stay detected (the grads controls too)."""
    from paracheck.pytest import mixin
    from paracheck.domain.backends import resolve
    from paracheck.domain.records import CheckId, Status

    from paracheck.testing import ContextParallelTesterMixin

    class TightLtx(_LtxTesterConfig, ContextParallelTesterMixin):
        paracheck_layouts = ("r2",)
        paracheck_atol = paracheck_rtol = 5e-6

    results = mixin._results(TightLtx(), resolve("auto"), 2)
    verdict, _ = results[("r2", "base", None)]
    grads = verdict.check(CheckId.GRADS)
    assert grads.status == Status.PASS, grads.detail
    assert "as close to the fp64 gradient as the single-device one" in grads.detail
    assert all(d.get("rule") == "fp64" and d["ratio"] < 1 for d in grads.data["per_rank"].values())
    controls = {c: v.status.value for (_, _, c), (v, _) in results.items() if c}
    trained = {c for c in controls if get_control(c).shows_in_training}  # the class takes no steps: named skips
    assert controls and {controls[c] for c in set(controls) - trained} == {"detected"}, controls
    assert all(controls[c] == "skip" for c in trained), controls


@pytest.mark.slow
def test_a_failing_transformers_forward_is_localized(tmp_path):
    """The parallel llama called without position_ids on packed rows: the first module beyond tolerance is the
    rotary embedding (it reads the positions), and the difference arises outside the model's modules (the
    decoder is called with other arguments), at the root, where the spec bends the forward."""
    from tests.support import SPECS

    run = run_paracheck(["--spec", f"{SPECS}:llama_packed_drops_position_ids", "--layouts", "tp2xfsdp2"], tmp_path)
    assert run.code == 1
    found = run.report["cases"][0]["localization"]["forward"]
    assert found["first"]["module"] == "model.rotary_emb" and found["origin"] == "<root>"
    assert found["last_agreeing"]["module"] == "model.embed_tokens" and found["ranks"] == [0, 1, 2, 3]
    assert any("tensors, the reference" in n["why"] for n in found["not_compared"])


#: The controls only a pipeline layout carries, detected (and localized) by the pipeline run below.
PIPELINE_PLANTED = {"tf-pp-stage-short"}


@pytest.mark.slow
def test_every_pipeline_control_is_localized_on_every_stage(tmp_path):
    """llama on pp4 (one layer per stage): each control that plants in the forward of a pipeline layout is
    localized where it plants, every stage's rank naming the same module; the stages' traces are joined, so the
    modules before it agree across the stage boundaries and each later stage says it was handed a difference."""
    from paracheck.adapters.transformers.controls import CONTROLS
    from paracheck.adapters.transformers.layout import TfLayout

    run = run_paracheck(["--models", "llama", "--layouts", "pp4", "--variants", "base", "--controls", "--steps", "0",
                         "--no-checkpoint"], tmp_path)
    assert run.code == 0, run.out
    cases = _planted_cases(run)
    planted = {n for n, c in CONTROLS.items() if c.plants_in and c.skip_reason(TfLayout.parse("pp4")) is None}
    assert PIPELINE_PLANTED <= planted and {c["control"] for c in cases} == planted
    assert all(c["status"] == "detected" for c in cases), [(c["control"], c["status"]) for c in cases]
    localized, total, missed = _share(cases)
    assert localized == total, missed
    found = next(c for c in cases if c["control"] == "tf-pp-stage-short")["localization"]["forward"]
    assert found["origin"] == "model.layers.0" and found["ranks"] == [0, 1, 2, 3] and not found["other_ranks"]
    modules = found["modules"]
    assert all(m["within"] for m in modules[:[m["module"] for m in modules].index("model.layers.0")])
    assert {m["stage"] for m in modules if m["module"].startswith("model.layers.3")} == {3}
    assert [n["module"] for n in found["not_compared"]] == ["model"]  # around every stage's layers
    assert [(b["stage"], b["inputs_within"]) for b in found["boundaries"]] == [(1, False), (2, False), (3, False)]
