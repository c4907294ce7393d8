"""`paracheck run --models transformers:all`: the plan of every family's cases (in process, configs only), its
shards, resuming from a report, and a few families on real gloo ranks (one dense with biases, one MoE, one
hybrid). The whole sweep is a command (docs/support-matrix.md), not a test."""

import json
import time

import pytest

transformers = pytest.importorskip("transformers")

from paracheck.adapters.transformers import fitting, sweep, tasks  # noqa: E402
from paracheck.domain.adapter import SweepRequest  # noqa: E402
from tests.support import run_paracheck  # noqa: E402


def _args(names="all", **kw):
    return SweepRequest(names, **dict(dict(nproc=4), **kw))


@pytest.fixture(scope="module")
def whole():
    return sweep.plan(_args())


def test_every_family_with_a_tp_plan_is_planned_and_every_case_fits_or_is_refused_by_name(whole):
    cases, refused, needed, _ = whole
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    with_tp = {n for n in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if getattr(CONFIG_MAPPING[n], "base_model_tp_plan", None)}
    causal = {c.model for c in cases if tasks.by_suffix(c.model)[1] is tasks.CAUSAL_LM}
    assert causal == with_tp  # the causal LMs keep their bare names
    planned = {tasks.by_suffix(c.model) for c in cases}
    assert ("llama", tasks.SEQUENCE_CLASSIFICATION) in planned and ("llava", tasks.IMAGE_TEXT) in planned
    assert {task for _, task in planned} == set(tasks.TASKS)
    assert all(refused[i] for i in refused)  # a refusal always says why
    by_family = {f.name: f for f in needed}
    for i, case in enumerate(cases):
        if i not in refused:
            family = by_family[case.model]
            assert fitting.refusal(family.config, fitting.Need.of(case.layout)) is None
            assert case.layout.world == 4


def test_every_image_text_family_has_a_builder_or_its_own_refusal(whole):
    """Every image-text family with a TP plan has a builder or a refusal naming its own reason: none is refused with
    the generic "the kit makes image inputs for ... only" (transformers 5.25.0; the generic words are
    `refused.lookup`'s, tested in test_tasks and test_audio)."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.25.0"):
        pytest.skip(f"the builders are written against 5.25.0's image-text families (this is {transformers.__version__})")
    cases, refused, _, _ = whole
    unbuilt = {cases[i].model: refused[i] for i in refused
               if tasks.by_suffix(cases[i].model)[1] is tasks.IMAGE_TEXT and "the kit makes image inputs" in refused[i]}
    assert not unbuilt


def test_steps_and_checkpoints_are_turned_on_per_family_one_layout_of_each_kind():
    """`--steps`/checkpoints reach the sweep's families of every task as the default tier turns them on: per family,
    the simplest layout of each kind (every one with --all); none when the request asks for neither."""
    request = dict(layouts="tp4,fsdp4,dpr4,pp4,tp2xfsdp2,dpr2xfsdp2")
    cases, refused, _, _ = sweep.plan(_args("llama-seq-cls", steps=3, checkpoint=True, **request))
    trained = {c.layout.name for c in cases if c.steps == 3 and c.checkpoint}
    assert trained == {c.layout.name for i, c in enumerate(cases) if i not in refused} & {"tp4", "fsdp4", "dpr4", "pp4"}
    assert trained and not any(c.steps or c.checkpoint for c in sweep.plan(_args("llama-seq-cls", **request))[0])


def test_shards_partition_the_sweep_and_keep_each_family_whole():
    cases, _, _, _ = sweep.plan(_args("all-token-cls"))  # one task's families: the rule is the same for every task
    parts = [sweep.plan(_args("all-token-cls", shard=f"{i}/3"))[0] for i in (1, 2, 3)]
    ids = [c.id for part in parts for c in part]
    assert sorted(ids) == sorted(c.id for c in cases)
    families = [{c.model for c in part} for part in parts]
    assert not (families[0] & families[1] or families[1] & families[2] or families[0] & families[2])


def test_resume_leaves_out_what_a_report_holds_but_errors(whole, tmp_path):
    cases, _, _, _ = whole
    first, second = cases[0], cases[1]
    report = tmp_path / "r.json"
    report.write_text(json.dumps({"cases": [
        {"model": first.model, "layout": first.layout.name, "variant": "base", "control": None, "status": "pass"},
        {"model": second.model, "layout": second.layout.name, "variant": "base", "control": None, "status": "error"}]}))
    resumed, _, _, carried = sweep.plan(_args(resume=str(report)))
    left = {c.id for c in resumed}
    assert first.id not in left and second.id in left and len(left) == len(cases) - 1
    # The held case's entry is carried into the resumed run's report, so a second interruption loses nothing.
    assert [(e["model"], e["layout"], e["status"]) for e in carried] == [(first.model, first.layout.name, "pass")]


def test_only_control_plans_that_control_alone_as_the_fixtures_do():
    """`--controls --only-control NAME` over the sweep: that control on every layout, no plain case (it ran the
    plain case and every control before)."""
    cases, _, _, _ = sweep.plan(_args("qwen3_moe", controls=True, only_control="tf-router-topk-on-shard"))
    assert cases and {c.control for c in cases} == {"tf-router-topk-on-shard"}
    every = sweep.plan(_args("qwen3_moe", controls=True))[0]
    assert {c.layout.name for c in cases} == {c.layout.name for c in every}


def test_an_unknown_family_or_shard_is_refused_by_name():
    with pytest.raises(ValueError, match="transformers:nosuch"):
        sweep.plan(_args("nosuch"))
    with pytest.raises(ValueError, match="--shard"):
        sweep.plan(_args("llama", shard="3/2"))


def test_the_sweep_is_refused_as_any_run_is_before_a_family_is_built(capsys, tmp_path):
    """The sweep launches through the host's one launch path, so it takes every run's checks first (once it had
    a launch of its own: it built every family before finding --report-json unwritable, and took no --nproc
    check)."""
    from paracheck.cli.main import main

    assert main(["run", "--models", "transformers:llama", "--report-json", str(tmp_path / "no" / "r.json")]) == 2
    assert main(["run", "--models", "transformers:llama", "--nproc", "0"]) == 2
    assert main(["run", "--models", "transformers:nosuch"]) == 2
    out, err = capsys.readouterr()
    assert "[family" not in out and "--report-json" in err and "--nproc 0: must be >= 1" in err
    assert "--models transformers:nosuch: not a family with a TP plan" in err


#: (family, layouts, the controls each must be detected on): the plan shapes the bundled fixtures lack.
SWEEP_PLANTED = [
    ("gpt_neox", "tp2", ("tf-rowwise-bias-before-reduce",)),  # dense, with row-parallel biases
    ("qwen2_moe", "tp2,tp2xep2", ("tf-embed-replicate", "tf-packed-as-colwise")),  # MoE with shared experts
    ("jamba", "tp2,fsdp2", ()),  # hybrid Mamba x attention, MoE
    ("granitemoe", "tp2", ("tf-router-topk-on-shard",)),  # a router scoring by F.linear, picking by Tensor.topk
]


@pytest.mark.slow
@pytest.mark.parametrize("family, layouts, controls", SWEEP_PLANTED)
def test_a_family_runs_on_real_ranks_through_the_sweep(tmp_path, family, layouts, controls):
    run = run_paracheck(["--models", f"transformers:{family}", "--nproc", "2", "--layouts", layouts, "--controls",
                         "--steps", "0", "--no-checkpoint"], tmp_path)  # the plan shapes' forward and gradients
    plain = [c for c in run.report["cases"] if c["control"] is None]
    assert plain and all(c["status"] in ("pass", "xfail") for c in plain), run.out
    assert run.code == 0, run.out
    for control in controls:
        assert {c["status"] for c in run.report["cases"] if c["control"] == control} == {_expected(family, control)}, \
            control


def _expected(family: str, control: str) -> str:
    """Detected; but the packed control is a named skip where this transformers gives the family no
    packed_colwise rule to bend (5.25 gives none to any model: its MoE experts are planned for EP only)."""
    if control != "tf-packed-as-colwise":
        return "detected"
    from transformers import AutoConfig

    plan = AutoConfig.for_model(family).base_model_tp_plan or {}
    return "detected" if "packed_colwise" in plan.values() else "skip"


@pytest.mark.slow
def test_a_resumed_sweep_carries_the_cases_its_report_held(tmp_path):
    """`--resume` over the sweep: what the report holds is neither built nor run again, and is carried into the new
    report, counted (it was once left out of it: a shard stopped twice kept only its last part)."""
    args = ["--models", "transformers:gpt_neox", "--nproc", "2", "--layouts", "tp2,fsdp2", "--steps", "0",
            "--no-checkpoint"]
    (tmp_path / "first").mkdir()
    (tmp_path / "then").mkdir()
    first = run_paracheck(args, tmp_path / "first")
    held = {c["id"]: c["status"] for c in first.report["cases"]}
    assert first.code == 0 and len(held) == 2, first.out
    (tmp_path / "first.json").write_text(json.dumps(first.report))
    then = run_paracheck([*args, "--resume", str(tmp_path / "first.json")], tmp_path / "then")
    assert then.code == 0 and "[family" not in then.out and "2 of 2 cases held there, 0 to run" in then.out, then.out
    assert {c["id"]: c["status"] for c in then.report["cases"]} == held
    assert all(c["resumed"] for c in then.report["cases"]) and then.report["summary"]["passed"] == 2


@pytest.mark.slow
def test_a_stopped_sweep_keeps_the_cases_decided_before_launch(tmp_path):
    """SIGTERM while a sweep's one launched case runs: the report holds the cases the sweep decided before launch
    (a family whose defaults do not build) and names the launched one as not run (the decided ones were once left
    out of a stopped sweep's report, and its counts)."""
    import os
    import signal
    import subprocess
    import sys

    from tests.support import ROOT

    report = tmp_path / "stopped.json"
    proc = subprocess.Popen([sys.executable, "-m", "paracheck", "run", "--models",
                             "transformers:llama,cohere_compass_text", "--nproc", "2", "--layouts", "tp2",
                             "--report-json", str(report)], cwd=ROOT, env=dict(os.environ, TMPDIR=str(tmp_path)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in proc.stdout:  # the families are built before the launch: stop once the last is
        seen.append(line)
        if line.startswith("[family 2/2]"):
            break
    time.sleep(2)
    proc.send_signal(signal.SIGTERM)
    out = "".join(seen) + proc.communicate(timeout=120)[0]
    assert proc.returncode == 3, out
    stopped = json.loads(report.read_text())
    assert [(c["model"], c["status"]) for c in stopped["cases"]] == [("cohere_compass_text", "skip")], out
    assert stopped["not_run"] == ["llama-tp2-sharded-load"], out
    [event] = stopped["events"]
    assert event["message"].startswith("SIGTERM: 1 of 2 cases finished, 1 not run"), event


def test_a_sweep_case_replays_by_its_family_name():
    from paracheck.adapters.transformers.layout import TfLayout
    from paracheck.adapters.transformers.sweep import FACTORY
    from paracheck.domain.case import Case
    from paracheck.domain.records import CaseStatus, Route
    from paracheck.results.report import replay_command
    from paracheck.results.verdict import Verdict

    case = Case("sarvam_moe", FACTORY, TfLayout(fsdp=4), route=Route.SHARDED_LOAD, library="transformers",
                payload="sarvam_moe")
    command = replay_command(Verdict(case, CaseStatus.ERROR, route=Route.SHARDED_LOAD), ["--nproc", "4"])
    assert "--models transformers:sarvam_moe" in command and "--spec" not in command


#: (family, layout, control) each detected in the tasks' world below; the vision-language plan shapes live only here.
TASKS_PLANTED = (("llama-seq-cls", "fsdp2", "tf-grad-divide"), ("llava-image-text", "tp2", "tf-cache-all-heads"),
                 ("llava-image-text", "fsdp2", "tf-skip-dp-reduce"), ("llava-image-text", "tp2", "tf-embed-replicate"),
                 ("llava-image-text", "tp2", "tf-vlm-head-unplanned"),
                 ("llava-image-text", "tp2", "tf-vlm-tower-partial"),
                 ("llava-image-text", "tp2", "tf-vlm-placeholders-on-shard"))


@pytest.mark.slow
def test_a_classification_head_and_a_vision_language_model_run_on_real_ranks(tmp_path):
    """Tasks beyond the causal LM through the sweep on 2 gloo ranks: a sequence-classification head (its loss a
    mean per data shard: tf-grad-divide is its scaling's negative control) and Llava (pixels and placeholders built
    here; parity.generate with an image per prompt, tf-cache-all-heads its control; the wrapper's head and the nested
    embedding planned replicate, structure's controls; the tower's output left partial into the projector and the
    placeholders marked on each rank's share of the row, the forward's, each localized where it plants). Llava's
    FSDP generate is transformers' declared bug (docs/upstream/transformers_fsdp_vlm_generate.md)."""
    run = run_paracheck(["--models", "transformers:llama-seq-cls,llava-image-text", "--nproc", "2", "--layouts",
                         "tp2,fsdp2", "--controls", "--steps", "0", "--no-checkpoint"], tmp_path)
    by = {(c["model"], c["layout"], c["control"]): c for c in run.report["cases"]}
    assert run.code == 0, run.out
    assert {k[:2]: c["status"] for k, c in by.items() if k[2] is None} == {
        ("llama-seq-cls", "fsdp2"): "pass", ("llama-seq-cls", "tp2"): "pass", ("llava-image-text", "tp2"): "pass",
        ("llava-image-text", "fsdp2"): "xfail"}
    generated = next(k for k in by[("llava-image-text", "tp2", None)]["checks"] if k["id"] == "parity.generate")
    assert generated["status"] == "pass"
    for key in TASKS_PLANTED:
        assert by[key]["status"] == "detected", key
    assert by[("llama-seq-cls", "tp2", "tf-vlm-head-unplanned")]["status"] == "skip"  # no nested language model
    assert "no vision tower feeding" in by[("llama-seq-cls", "tp2", "tf-vlm-tower-partial")]["reason"]
    assert "marks no image placeholder" in by[("llama-seq-cls", "tp2", "tf-vlm-placeholders-on-shard")]["reason"]
    planted = {k[2]: by[k]["localization"]["planted"] for k in TASKS_PLANTED[-2:]}
    assert planted["tf-vlm-tower-partial"]["named"] == "model.vision_tower.encoder.layers.0.mlp.fc2"
    assert all(p["localized"] for p in planted.values()), planted
    assert {c["status"] for k, c in by.items() if k[2]} <= {"detected", "skip", "inconclusive"}
