"""The torch adapter: its layout grammar and spec validation (in process), then real gloo runs of the llama
example (every layout passes), of its planted bug (fails, on every rank), of a spec whose parallelize raises,
and of every control (each detected)."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from paracheck.domain.registry import parse_layout
from paracheck.adapters.torch import spec as specs
from paracheck.adapters.torch.adapter import ADAPTER
from paracheck.adapters.torch.cases import expand
from paracheck.adapters.torch.controls import CONTROLS
from paracheck.adapters.torch.layout import NAMED, TOKENS, TorchLayout, TorchLayoutError, layouts_for, parse_layouts
from paracheck.domain.adapter import Adapter, CaseRequest
from paracheck.domain.case import Case, SpecError
from tests.support import run_paracheck

EXAMPLE = "examples/llama_tp_fsdp.py:spec"
BUG = "examples/llama_tp_fsdp_bug.py:spec"
SPECS = "tests/torch_specs.py"

degrees = st.sampled_from([1, 1, 2, 3, 4])
layouts = st.builds(TorchLayout, dp=degrees, fsdp=degrees, cp=degrees, tp=degrees).filter(lambda l: l.world > 1)


# -- names ---------------------------------------------------------------------------------------


@given(layouts, st.permutations(list(TOKENS)))
def test_a_name_in_any_order_reads_back_as_the_same_layout(layout, order):
    assert TorchLayout.parse(layout.name) == layout
    text = "x".join(f"{t}{getattr(layout, t)}" for t in order if getattr(layout, t) > 1)
    assert TorchLayout.parse(text) == layout
    assert layout.world == math.prod(getattr(layout, t) for t in TOKENS)


@given(layouts)
def test_coordinates_are_row_major_with_tp_fastest_and_each_batch_shard_is_held_by_world_over_dp_ranks(layout):
    seen = {}
    for rank in range(layout.world):
        c = layout.coords(rank)
        assert sum(c[t] * math.prod(getattr(layout, u) for u in TOKENS[i + 1:]) for i, t in enumerate(TOKENS)) == rank
        seen.setdefault(layout.dp_index(rank), []).append(rank)
    assert sorted(seen) == list(range(layout.dp_degree))
    assert all(len(ranks) == layout.world // layout.dp_degree for ranks in seen.values())
    assert layout.mesh_dims == tuple(t for t in TOKENS if getattr(layout, t) > 1)


@pytest.mark.parametrize("text,words", [("tp2xtp2", "appears twice"), ("tp0", ">= 1"), ("u2", "is not one of"),
                                        ("", "write degrees")])
def test_bad_names_say_which_part_and_rule(text, words):
    with pytest.raises(TorchLayoutError, match=words):
        TorchLayout.parse(text)


def test_the_canonical_name_writes_tp_first_and_the_registry_reads_it():
    assert TorchLayout.parse("fsdp2xtp2").name == "tp2xfsdp2" and NAMED[:2] == ("pp", "tp")
    assert parse_layout("torch", "fsdp2xtp2") == TorchLayout(fsdp=2, tp=2)
    names = {l.name for l in layouts_for(4)}
    assert {"tp4", "fsdp4", "tp2xfsdp2", "dp2xfsdp2", "cp4"} <= names and all(l.world == 4 for l in layouts_for(4))
    with pytest.raises(TorchLayoutError, match="--nproc is 2"):
        parse_layouts("tp4", 2)


def test_a_case_crosses_to_the_ranks_and_back():
    case = Case("m", EXAMPLE, TorchLayout(fsdp=2, tp=2), library="torch", control="torch-shard-swap")
    assert Case.from_json(case.to_json(), parse_layout) == case


def test_the_adapter_object_keeps_the_protocol():
    assert isinstance(ADAPTER, Adapter) and ADAPTER.name == "torch" and "fp32" in ADAPTER.dtypes
    assert ADAPTER.controls() is CONTROLS and ADAPTER.fixtures() == {}
    assert ADAPTER.claims(specs.load(EXAMPLE)) and not ADAPTER.claims(lambda: None)
    with pytest.raises(ValueError, match="explore does not draw torch specs"):
        ADAPTER.explore_target(EXAMPLE, "all", 4)


# -- specs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,words", [
    ("no_parallelize", r"missing parallelize\(model, mesh, layout\)"),
    ("no_build", r"missing build\(\)"),
    ("bad_layouts", "its layouts: layout 'tp2xring2'"),
    ("bad_reduction", "grad_reduction 'avg' must be one of mean, sum"),
])
def test_a_malformed_spec_names_what_is_missing(name, words):
    with pytest.raises(SpecError, match=words):
        specs.loaded(f"{SPECS}:{name}")


def _request(path, layouts="all", nproc=2, **kw):
    return CaseRequest([("m", path)], layouts, nproc, spec=True, **kw)


@pytest.mark.parametrize("name,layouts,words", [
    ("inputs_raise", "all", r"inputs\('dp2', 'base'\) raised KeyError: 'vocab'"),
    ("inputs_list", "all", "must return a tensor or a dict of forward kwargs, got list"),
    ("refuses_tp", "tp2", "refuses every layout asked for .*tp2: the spec refuses tp2: no TP here"),
    ("only_tp4", "all", r"none of its layouts \(tp4\) has 2 ranks"),
])
def test_a_spec_that_breaks_a_rule_is_refused_before_any_rank_starts(name, layouts, words):
    with pytest.raises(SpecError, match=words):
        expand(_request(f"{SPECS}:{name}", layouts))


def test_a_refused_layout_among_others_is_a_case_the_ranks_skip_and_cp_waits_to_be_asked_for():
    spec = specs.loaded(f"{SPECS}:refuses_tp")
    cases = expand(_request(f"{SPECS}:refuses_tp", "tp2,fsdp2"))
    assert [c.layout.name for c in cases] == ["tp2", "fsdp2"]
    assert specs.refusal(spec, TorchLayout(tp=2)) == "the spec refuses tp2: no TP here"
    assert "context_parallel" in specs.refusal(spec, TorchLayout(cp=2))
    assert all(l.cp == 1 for l in (c.layout for c in expand(_request(f"{SPECS}:refuses_tp", nproc=4))))
    assert specs.split_problem(specs.call_inputs("p", specs.loaded(f"{SPECS}:batch_odd"), TorchLayout(fsdp=2), "base"),
                               TorchLayout(fsdp=2)) == "input: batch 3 does not split into dp x fsdp = 2 equal shards"


def test_controls_come_after_each_plain_case_and_only_fp32_runs():
    cases = expand(_request(EXAMPLE, "tp2xfsdp2", 4, controls=True))
    assert [c.control for c in cases] == [None, *CONTROLS]
    assert {c.library for c in cases} == {"torch"}
    with pytest.raises(SpecError, match="runs fp32 only"):
        expand(_request(EXAMPLE, "tp2", dtype="bf16"))


def test_a_missing_function_exits_2_in_one_line_naming_it(tmp_path):
    run = run_paracheck(["--spec", f"{SPECS}:no_parallelize", "--nproc", "2"], tmp_path)
    assert run.code == 2 and run.out.count("\n") == 1, run.out
    assert "missing parallelize(model, mesh, layout)" in run.out


# -- real runs -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_example_passes_every_layout_on_two_ranks_and_each_bug_fails_on_every_rank(tmp_path):
    run = run_paracheck(["--spec", EXAMPLE, "--spec", BUG, "--spec", BUG + "_norms", "--spec",
                         f"{SPECS}:parallelize_raises", "--spec", f"{SPECS}:tp_only", "--spec", f"{SPECS}:llama_late_bug",
                         "--nproc", "2", "--layouts", "tp2,fsdp2", "--quiet"], tmp_path)
    assert run.code == 1, run.out
    names = {"llama_tp_fsdp.py:spec": "good", "llama_tp_fsdp_bug.py:spec": "bug", "parallelize_raises": "raises",
             "tp_only": "tp_only", "spec_norms": "norms", "llama_late_bug": "late"}
    by = {(names[c["model"]], c["layout"]): c for c in run.report["cases"]}
    for layout in ("tp2", "fsdp2"):
        assert by["good", layout]["status"] == "pass", by["good", layout]
        assert {c["id"] for c in by["good", layout]["checks"]} >= {"structure.mesh", "structure.tp_shards",
                                                                  "parity.forward", "parity.inference",
                                                                  "parity.grads", "parity.loss"}
    bug = {c["id"]: c for c in by["bug", "tp2"]["checks"]}
    assert by["bug", "tp2"]["status"] == "fail" and bug["parity.forward"]["failed_ranks"] == [0, 1]
    assert bug["structure.tp_shards"]["status"] == "pass"  # the weights are right; the missing reduce is not
    assert by["bug", "fsdp2"]["status"] == "skip"  # the bug example declares the layouts that show it
    norms = {c["id"]: c for c in by["norms", "tp2"]["checks"]}  # sequence-parallel norms' grads never all-reduced
    assert norms["parity.forward"]["status"] == "pass" and norms["parity.grads"]["failed_ranks"] == [0, 1]
    assert "layers.0.attention_norm.weight" in norms["parity.grads"]["detail"]
    idle = {c["id"]: c for c in by["tp_only", "fsdp2"]["checks"]}
    assert idle["structure.mesh"]["status"] == "fail" and idle["parity.forward"]["status"] == "pass"
    assert "no parameter is sharded on the fsdp dimension" in idle["structure.mesh"]["detail"]
    raised = by["raises", "tp2"]
    assert raised["status"] == "error" and "RuntimeError: plan names a module" in raised["reason"]
    _assert_localized(by)


def _assert_localized(by: dict) -> None:
    """Where each bug arises, as localization names it on every rank: the Partial w2 (its output is the partial
    sum, compared as held), the norms' gradients, and a weight planted late (every module before it agrees once
    its shards are read back: sequence-parallel, colwise, rowwise, FSDP)."""
    for layout in ("tp2", "fsdp2"):
        late = by["late", layout]["localization"]["forward"]
        assert late["origin"] == "layers.1.feed_forward.w2" and late["ranks"] == [0, 1], late
        assert late["not_compared"] == [] and late["pass"] == "training"
        order = [m["module"] for m in late["modules"]]
        assert all(m["within"] for m in late["modules"][:order.index("layers.1.feed_forward.w2")])
    partial = by["bug", "tp2"]["localization"]
    assert partial["forward"]["origin"] == "layers.0.feed_forward.w2" and partial["inference"]["pass"] == "no_grad"
    norms = by["norms", "tp2"]["localization"]
    assert "forward" not in norms and norms["grads"]["origin"].endswith("_norm.weight")
    assert norms["grads"]["pattern"].endswith("everything else exact")


@pytest.mark.slow
def test_four_ranks_pass_tp_fsdp_hsdp_and_every_control_is_detected(tmp_path):
    run = run_paracheck(["--spec", EXAMPLE, "--nproc", "4", "--layouts", "tp2xfsdp2,dp2xfsdp2,tp4", "--controls",
                         "--quiet"], tmp_path)
    assert run.code == 0, run.out
    plain = {c["layout"]: c for c in run.report["cases"] if c["control"] is None}
    assert {k: v["status"] for k, v in plain.items()} == {"tp2xfsdp2": "pass", "dp2xfsdp2": "pass", "tp4": "pass"}
    detected = {(c["layout"], c["control"]) for c in run.report["cases"] if c["status"] == "detected"}
    # parity.steps runs on all three (the tier's one layout per kind and pair of kinds: tp4, then tp2xfsdp2 for fsdp
    # and tp x fsdp, dp2xfsdp2 for dp and dp x fsdp).
    assert detected == {("tp2xfsdp2", "torch-shard-swap"), ("tp2xfsdp2", "torch-skip-dp-reduce"),
                        ("tp2xfsdp2", "torch-grad-sum"), ("dp2xfsdp2", "torch-skip-dp-reduce"),
                        ("dp2xfsdp2", "torch-grad-sum"), ("tp4", "torch-shard-swap"),
                        ("tp2xfsdp2", "torch-clip-local-norm"), ("dp2xfsdp2", "torch-clip-local-norm"),
                        ("tp4", "torch-clip-local-norm"), ("tp4", "torch-decay-twice")}
    # Each control that declares where it plants (and plants in a model: not the pipeline's, tested with the
    # pipelines) is localized there, on every layout it was detected on.
    placed = {name for name, control in CONTROLS.items() if control.plants_in
              and control.applies(TorchLayout.parse("tp2xfsdp2")) is None}
    cases = [c for c in run.report["cases"] if c["control"] in placed and c["status"] == "detected"]
    assert {c["control"] for c in cases} == placed
    missed = [(c["layout"], c["control"], c["localization"].get("planted")) for c in cases
              if not (c["localization"].get("planted") or {}).get("localized")]
    assert not missed, missed
    swap = next(c for c in cases if c["control"] == "torch-shard-swap" and c["layout"] == "tp2xfsdp2")
    assert swap["localization"]["planted"]["named"] == "tok_embeddings" == swap["localization"]["planted"]["planted_in"]


@pytest.mark.slow  # no launch: two cases of four ranks in this process (34 s wall at load 8)
def test_in_one_process_tp4_passes_and_the_shard_swap_fails_every_rank_as_on_gloo(tmp_path):
    """`torch-shard-swap` picks the next TP rank's shard by this rank's group rank: planted once for all ranks it
    was a RankDependent skip in a local world; planted per rank (`Control.per_rank`) it fails structure.tp_shards and
    every parity check on ranks 0-3, as on gloo (forward 2.70 there and here, session 20)."""
    import os

    import torch.distributed as dist

    from paracheck.domain.backends import get_backend
    from paracheck.domain.records import CheckId, RankStatus, Status
    from paracheck.rank.localrun import run_local_case
    from paracheck.world.localworld import LocalWorld

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    os.makedirs(tmp_path / "refs")
    found = {}
    with LocalWorld(4) as world:
        for index, control in enumerate((None, "torch-shard-swap")):
            case = Case("spec", EXAMPLE, TorchLayout(tp=4), library="torch", control=control)
            found[control] = run_local_case(index, case, get_backend("gloo"), world, str(tmp_path / "refs"),
                                            str(tmp_path / f"case{index}"))
    for control, results in found.items():
        assert [r.rank for r in results] == [0, 1, 2, 3]
        for result in results:
            assert result.status == RankStatus.OK, (control, result.rank, result.reason)
            checks = {c.id: c.status for c in result.checks}
            wanted = Status.FAIL if control else Status.PASS
            for check in (CheckId.TP_SHARDS, CheckId.FORWARD, CheckId.GRADS, CheckId.LOSS):
                assert checks[check] == wanted, (control, result.rank, check, checks[check])
