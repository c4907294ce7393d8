"""Localization proven on the controls, on real gloo ranks: every control that breaks the forward or the
gradients is localized to the place it declares (`Control.plants_in`), and the report says where."""

import pytest

from paracheck.adapters import get_control
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
    run = run_paracheck(["--models", "qwen3", "--layouts", "tp2xfsdp2", "--variants", "base", "--controls"], tmp_path)
    assert run.code == 0, run.out
    cases = _planted_cases(run)
    assert {c["control"] for c in cases} == {"tf-norm-replicate", "tf-skip-dp-reduce", "tf-grad-divide"}
    localized, total, missed = _share(cases)
    assert localized == total, missed
    norms = next(c for c in cases if c["control"] == "tf-norm-replicate")["localization"]["grads"]
    assert norms["pattern"].endswith("everything else exact")
    off = [p["param"] for p in norms["params"] if not p["within"]]
    assert off and all(get_control("tf-norm-replicate").planted_at(p) for p in off)
    divide = next(c for c in cases if c["control"] == "tf-grad-divide")["localization"]["grads"]
    assert divide["pattern"].startswith("every gradient off by 0.5 = 1/")
