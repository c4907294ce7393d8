"""parity.steps for transformers: the Trainer's arguments and data, the single-process switch, in process; then one
real 2-rank gloo run of `paracheck run` where the plain cases' steps pass and clip, each new control is detected by
parity.steps alone, the pipeline's abort is declared and TP on CPU trains into the declared accumulation bug."""

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from packaging.version import Version

transformers = pytest.importorskip("transformers")

from paracheck.adapters.transformers import inputs, steps  # noqa: E402
from paracheck.adapters.transformers.controls import CONTROLS  # noqa: E402
from paracheck.adapters.transformers.layout import TfLayout  # noqa: E402
from paracheck.checks.steps import StepRecord, compare_steps  # noqa: E402
from paracheck.domain.records import CheckId  # noqa: E402
from tests.support import run_paracheck  # noqa: E402

#: (control, layout on 2 ranks): each parity.steps control where it applies (gemma3 ties its embedding and head).
STEPS_PLANTED = [("tf-clip-local-norm", "fsdp2"), ("tf-decay-twice", "dpr2"), ("tf-untied-embeddings", "fsdp2"),
                 ("tf-untied-embeddings", "dpr2")]
NEW = {c for c, _ in STEPS_PLANTED}
#: Before 5.24 the Trainer's optimizer takes the parameters an evaluation left gathered, so no data-parallel layout
#: trains right (declared; docs/upstream/transformers_trainer_evaluate_unsharded.md): what these tests hold
#: (a plain pass, a control detected against it) cannot show there.
DP_TRAINS = Version(transformers.__version__) >= Version("5.24.0")
DP_SKIP = ("transformers < 5.24.0 trains no data-parallel layout right after an evaluation (a declared upstream bug: "
           "docs/upstream/transformers_trainer_evaluate_unsharded.md)")


def test_the_trainer_is_set_up_as_the_issue_asks(tmp_path):
    args = steps.arguments(str(tmp_path), 2, 3, True)
    assert (args.gradient_accumulation_steps, args.max_steps, args.weight_decay) == (2, 3, steps.WEIGHT_DECAY) > (0,)
    assert args.lr_scheduler_type == "constant" and args.train_sampling_strategy == "sequential"
    assert args.save_strategy == "no" and args.report_to == [] and args.max_grad_norm == steps.MAX_GRAD_NORM
    assert args.optim == "adamw_torch" and args.adam_epsilon == steps.ADAM_EPSILON


def test_the_float64_steps_of_a_mixture_of_experts_run_with_the_experts_eager_loop(tmp_path):
    """`steps.reference(wide=True)` on the bundled qwen3_moe, in one process: its experts' default `grouped_mm`
    takes no float64 (the negative control: the same load without `WIDE_LOAD` raises there), so the float64 steps
    load with the eager loop and train, in float64, as far from the float32 steps as the reference's rounding."""
    import torch

    from paracheck.adapters.transformers import fixtures, tasks
    from paracheck.checks.steps import reference_error

    path = fixtures.save("qwen3_moe", str(tmp_path))
    data = steps.batches(lambda seed: inputs.global_batch("base", 1, 128, seed), 1)
    with pytest.raises(RuntimeError, match="Float32, BFloat16 or Float16"):
        wide_default = tasks.load(path, dtype=torch.float64)
        wide_default(**inputs.without_labels(data[0]), use_cache=False)
    narrow = steps.reference(("moe", 32), path, data, 2, 1, str(tmp_path))
    wide = steps.reference(("moe", 64), path, data, 2, 1, str(tmp_path), wide=True)
    assert all(p.dtype == torch.float64 for p in wide.records[0].params.values())
    [own] = reference_error(narrow.records, wide.records)
    assert 0 < max(float(e.max()) for e in own.values()) < 1e-5


def test_the_rows_are_the_micro_batches_end_to_end_and_fresh_each():
    data = steps.batches(lambda seed: inputs.global_batch("left_pad", 2, 128, seed), 3)
    assert len(data) == (3 + 1) * steps.MICRO  # the evaluation's batches first
    rows = steps.Rows(data)
    assert len(rows) == (3 + 1) * steps.MICRO * 2
    assert (rows[2]["input_ids"] == data[1]["input_ids"][0]).all()
    assert not (data[0]["input_ids"] == data[1]["input_ids"]).all()


def test_packed_image_patches_reach_each_device_batch_as_inputs_share_cuts_them():
    """A tensor packing every row's patches along dim 0 (hunyuan_vl's, paddleocr_vl's) is cut per row by `Rows`
    and laid end to end again by its collator, so each device batch of the Trainer is that data-parallel share of
    the global batch (the default collator stacked one patch per row: a shape error in the vision tower)."""
    import torch

    batch = {"input_ids": torch.arange(8).view(4, 2), "pixel_values": torch.arange(24.0).view(12, 2),
             "image_grid_thw": torch.tensor([[1, 1, 3]] * 4)}
    rows = steps.Rows([batch])
    for index in range(2):
        device = rows.collate([rows[2 * index], rows[2 * index + 1]])
        expected = inputs.share(batch, index, 2)
        assert device.keys() == expected.keys() and all(torch.equal(device[k], expected[k]) for k in device)


@settings(max_examples=40, deadline=None)
@given(dp=st.integers(1, 4), per=st.integers(1, 3), blocks=st.lists(st.integers(1, 4), min_size=0, max_size=3),
       first=st.booleans())
def test_one_rule_cuts_rows_for_every_share_and_every_device_batch(dp, per, blocks, first):
    """`inputs.rows` is the one rule: each entry below records the row it belongs to, so a share (`inputs.share`),
    a Trainer device batch (`Rows` then its collator) and the stand-in's rank slots (`StandIn.per_rank`) must each
    hold exactly their rows' entries, every packed block whole and in order, whatever the blocks per row and whether
    `input_ids` comes first."""
    import torch

    count = dp * per
    batch = {f"packed{i}": torch.arange(count).repeat_interleave(b) * 10 + torch.arange(b).repeat(count)
             for i, b in enumerate(blocks)}
    ids = {"input_ids": torch.arange(count).unsqueeze(1).expand(count, 3) * 10}
    batch = {**ids, **batch} if first else {**batch, **ids}
    items = steps.Rows([batch])
    assert len(items) == inputs.rows_in(batch) == count
    for index in range(dp):
        mine = range(index * per, (index + 1) * per)
        expected = {k: torch.cat([v[v // 10 == r] if k != "input_ids" else v[r:r + 1] for r in mine])
                    for k, v in batch.items()}
        share = inputs.share(batch, index, dp)
        device = items.collate([items[r] for r in mine])
        assert share.keys() == device.keys() == batch.keys()
        assert all(torch.equal(share[k], expected[k]) and torch.equal(device[k], expected[k]) for k in batch)
    assert all(torch.equal(inputs.joined([inputs.share(batch, i, dp) for i in range(dp)])[k], batch[k]) for k in batch)
    layout = TfLayout.parse(f"tp2xdpr{dp}") if dp > 1 else TfLayout.parse("tp2")
    slots = steps.StandIn("", layout).per_rank([batch])[0]
    world = [inputs.share(batch, layout.dp_index(r), layout.dp) for r in range(layout.world)]
    assert all(torch.equal(slots[k], torch.cat([w[k] for w in world])) for k in batch)


def test_the_single_process_switch_hides_the_world_and_gives_it_back(monkeypatch):
    from accelerate.state import PartialState

    for key, value in {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(key, value)
    with steps._single_process_env():
        assert not {"RANK", "WORLD_SIZE", "LOCAL_RANK"} & set(os.environ)
        assert PartialState(cpu=True).num_processes == 1
    assert os.environ["WORLD_SIZE"] == "4" and PartialState._shared_state == {}


def test_the_gradient_norm_is_reported_and_named_where_the_parameters_part():
    import torch

    ref = [StepRecord(torch.tensor(1.0), {"w": torch.ones(2)}, grad_norm=2.0)]
    norm_only = [StepRecord(torch.tensor(1.0), {"w": torch.ones(2)}, grad_norm=1.5)]
    both = [StepRecord(torch.tensor(1.0), {"w": torch.full((2,), 1.1)}, grad_norm=1.5)]
    alone = compare_steps(norm_only, ref, 1e-5, 1e-5)
    assert alone.status.value == "pass" and alone.data["steps"][0]["grad_norm"] == 1.5
    result = compare_steps(both, ref, 1e-5, 1e-5)
    assert result.status.value == "fail" and result.detail.startswith("step 1 of 1: grad_norm 1.5 != reference 2; ")
    assert "worst w" in result.detail


def test_a_first_step_whose_loss_and_norm_are_dp_times_the_references_is_typed_as_the_trainers_scaling():
    """The site of transformers' Trainer scaling a shard-mean loss by dp (declared upstream by it): a generic
    classification head (its forward takes **kwargs, its loss a plain mean) and step 1's loss and gradient norm both
    `dp` times the reference's; a loss alone, another factor, no data parallelism, or a model whose loss is not that
    head's (a user's, a causal LM's) are not it."""
    import torch

    config = transformers.LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, num_labels=2, pad_token_id=0)
    head = transformers.LlamaForSequenceClassification(config)
    causal = transformers.LlamaForCausalLM(config)

    def typed(loss, norm, layout="fsdp2", ref=(2.334, 10.84), model=head):
        mine = [StepRecord(torch.tensor(loss), {"w": torch.ones(2)}, grad_norm=norm)]
        result = compare_steps(mine, [StepRecord(torch.tensor(ref[0]), {"w": torch.ones(2)}, grad_norm=ref[1])],
                               1e-5, 1e-5)
        return steps._loss_times_dp(result, TfLayout.parse(layout), model, 1e-5, 1e-5)

    assert typed(4.668, 21.68) == typed(4.668, 21.68, "tp2xfsdp2") == steps.LOSS_TIMES_DP
    assert typed(4.668 * 2, 21.68 * 2, "dpr2xfsdp2") == steps.LOSS_TIMES_DP
    assert typed(4.668, 10.84) == typed(2.334 * 1.5, 10.84 * 1.5) == typed(4.668, 21.68, "tp2", (2.334, 10.84)) == ""
    assert typed(4.6681, 21.68) == ""  # past the tolerance of the scaled loss
    assert typed(4.668, 21.68, model=causal) == ""  # the same figures on a loss that is not the generic head's


def test_each_new_control_names_where_it_cannot_apply():
    assert CONTROLS["tf-clip-local-norm"].applies(TfLayout(dpr=4)) is not None
    assert CONTROLS["tf-clip-local-norm"].applies(TfLayout(fsdp=4)) is None
    assert CONTROLS["tf-decay-twice"].applies(TfLayout(fsdp=4)) is not None
    assert CONTROLS["tf-decay-twice"].applies(TfLayout(dpr=2, fsdp=2)) is None
    assert CONTROLS["tf-untied-embeddings"].applies(TfLayout(pp=4)) is not None
    assert all(CheckId.STEPS in CONTROLS[name].must_trip for name in NEW)


@pytest.fixture(scope="module")
def steps_run(tmp_path_factory):
    """One 2-rank world: gemma3 (tied) on FSDP, replicas, a pipeline and TP, base inputs, every control."""
    return run_paracheck(["--models", "gemma3", "--layouts", "fsdp2,dpr2,pp2,tp2", "--nproc", "2", "--variants",
                          "base", "--controls", "--steps", "3", "--no-checkpoint"], tmp_path_factory.mktemp("steps"))


def _cases(run, control=None):
    return {c["layout"]: c for c in run.report["cases"] if c["control"] == control}


def _steps(case):
    return next(k for k in case["checks"] if k["id"] == "parity.steps")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp2", "dpr2"])
@pytest.mark.skipif(not DP_TRAINS, reason=DP_SKIP)
def test_the_plain_cases_steps_agree_and_every_step_clips(steps_run, layout):
    case = _cases(steps_run)[layout]
    assert case["status"] == "pass", steps_run.out
    check = _steps(case)
    assert check["status"] == "pass" and not check["failed_ranks"] and check["max_abs"] < 1e-5
    ranks = check["data"]["per_rank"]
    assert sorted(ranks) == ["0", "1"] and all(r["clipped"] == [True] * 3 for r in ranks.values()), ranks
    assert all(s["reference_grad_norm"] > steps.MAX_GRAD_NORM for r in ranks.values() for s in r["steps"])


@pytest.mark.slow
@pytest.mark.parametrize("control,layout", STEPS_PLANTED)
@pytest.mark.skipif(not DP_TRAINS, reason=DP_SKIP)
def test_each_new_control_is_detected_by_the_steps_alone(steps_run, control, layout):
    case = _cases(steps_run, control)[layout]
    assert case["status"] == "detected", (case["reason"], steps_run.out)
    assert _steps(case)["status"] == "fail" and _steps(case)["failed_ranks"] == [0, 1]
    # Nothing excused by the reference's own rounding error (`steps._within_own_error`). The decay planted twice
    # parts by 9.1e-5 at step 1 (lr x decay x |w|), within the widest excuse: the float64 steps run on each rank,
    # find the reference within the tolerance of them (1.3e-6 on gemma3), and excuse nothing; the other plants part
    # past reach, where they never run.
    ranks = _steps(case)["data"]["per_rank"].values()
    assert not any("excused" in s or "beyond" in s for r in ranks for s in r["steps"])
    measured = [r["reference_error"].get("max_abs", r["reference_error"]) for r in ranks if "reference_error" in r]
    assert len(measured) == (2 if control == "tf-decay-twice" else 0) and all(e < 1e-5 for e in measured)
    older = {k["id"]: k["status"] for k in case["checks"] if k["id"] != "parity.steps"}
    assert older and set(older.values()) <= {"pass", "skip"}, older


@pytest.mark.slow
def test_the_pipeline_abort_is_declared_and_tp_trains_into_the_declared_accumulation_bug(steps_run):
    """TP on CPU trains (the kit standing in for the ParallelismConfig accelerate refuses there), and gemma3's
    q_norm/k_norm, planned replicated_with_grad_allreduce, meet the upstream accumulation bug: a failing check,
    typed by that plan style, which the shipped entry declares (`--known-failures none` leaves it failing)."""
    from paracheck.results import known

    if DP_TRAINS:
        assert steps_run.code == 0, steps_run.out
    else:  # the declared Trainer bug: the plain dp cases are xfail by it; what fails beside them is on dp layouts
        for layout in ("fsdp2", "dpr2"):
            assert "transformers_trainer_evaluate_unsharded" in (_cases(steps_run)[layout].get("known_failure") or "")
        odd = {(c["layout"], c["control"], c["status"]) for c in steps_run.report["cases"]
               if c["status"] not in ("pass", "xfail", "skip", "detected", "inconclusive")}
        # 5.23: the planted decay writes through the freed storage and both ranks die (3 runs of 3), a named error
        assert odd <= {("dpr2", "tf-decay-twice", "error")}, odd
    pp = _cases(steps_run)["pp2"]
    assert pp["status"] == "xfail" and "_sync_replicated_trainable_parameters" in _steps(pp)["detail"]
    case = _cases(steps_run)["tp2"]
    tp = _steps(case)
    assert case["status"] == "xfail" and "post-accumulate-grad hook" in case["reason"], case
    assert tp["status"] == "fail" and tp["failure"]["site"] == "tp_plan:replicated_with_grad_allreduce"
    assert "_norm.weight" in tp["detail"] and "ParallelismConfig" in tp["data"]["per_rank"]["1"]["stood_in"]["why"]
    entry = next(e for e in known.load(known.SHIPPED) if e.site == tp["failure"]["site"])
    assert entry.check == "parity.steps" and not known.load("none")


def test_the_untie_control_runs_where_a_fixture_ties_in_the_default_tier():
    """llama's cases train first (one layout of each kind), but llama does not tie: the control also runs, with
    steps, on gemma3's first case, which does."""
    from paracheck.adapters.transformers import cases
    from paracheck.cli.tiers import runs
    from paracheck.domain.tier import with_training
    from paracheck.domain.tier import needs_training as _needs_training

    matrix = [c for m in ("llama", "gemma3") for c in cases.expand(m, "all", 4, ["base"], controls=True)]
    chosen = with_training(matrix, 3, False, needs=_needs_training, runs=runs)
    untie = [c for c in chosen if c.control == "tf-untied-embeddings" and runs(c)]
    assert untie and all(c.model == "gemma3" and c.steps == 3 for c in untie)
    twin = next(c for c in chosen if c.control is None and c.model == "gemma3" and c.layout == untie[0].layout)
    assert twin.steps == 3


@pytest.mark.parametrize("name, cause", [("UltraVBertForSequenceClassification", True),
                                         ("LlamaForSequenceClassification", True), ("LlamaForCausalLM", False),
                                         ("GPTNeoXForSequenceClassification", True)])
def test_the_mean_loss_cause_is_read_from_generic_heads_and_from_heads_with_their_own_mean_loss(name, cause):
    """UltraVBert's sequence head is its own class (torch's CrossEntropyLoss(), **kwargs, no num_items_in_batch):
    the Trainer scales its loss by dp as the generic heads' (the sweep's ultravbert-seq-cls dpr4/fsdp4: loss and
    gradient norm exactly 4x at step 1), so the step's failure carries the declared site; so is GPT-NeoX's, which
    calls the library's classification loss without the Trainer's count (session 23's gpt_neox-seq-cls dpr4/fsdp4,
    4x, untyped before); a causal LM's loss reads num_items_in_batch and does not."""
    cls = getattr(transformers, name, None)
    if cls is None:
        pytest.skip(f"this transformers has no {name}")
    assert steps._mean_loss_head(object.__new__(cls)) is cause


def test_a_model_whose_training_forward_samples_is_refused_its_steps_by_measure():
    """PhiMoE's sparsemixer samples its routing in train mode (the sweep's phimoe dpr4, fsdp4 and fsdp4xep2 parted
    at step 1 by 1.1e-2 on the embedding): two seeds move its train-mode logits, so `run` skips the steps saying so;
    a model that draws nothing in train mode (dropout off, as the kit's configs are) moves by exactly 0, and the
    measure leaves the shared reference as it was (mode and buffers); a dropout left on is never read as sampling."""
    import torch
    import transformers

    from paracheck.adapters.transformers import fitting, tasks

    batch = inputs.global_batch("base", 1, 128, seed=0)
    for config_class, samples in ((transformers.PhimoeConfig, True), (transformers.LlamaConfig, False)):
        config = tasks.prepared(fitting.tiny(config_class), tasks.CAUSAL_LM)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        moved = steps._samples_in_training(model, batch)
        assert (moved > 0) is samples, (config_class.__name__, moved)
        assert not model.training and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    model.train()  # a dropout left on is the kit's config to fix: never a skip
    model.model.layers[0].self_attn.attention_dropout = 0.5
    dropped = torch.nn.Dropout(0.5)
    model.model.layers[0].mlp.add_module("drop", dropped)
    assert steps._samples_in_training(model, batch) == 0.0


def test_a_failed_step_is_judged_again_with_the_references_own_error_measured_in_float64():
    """`steps._within_own_error`, in process: lfm3 tp4's figures (1.55e-5 from the float32 reference, which is
    2.1e-5 from its float64 steps there) pass, saying so in the detail; so do axk1-seq-cls tp4's, whose steps agree
    but whose evaluation after them is 2.05e-4 from a reference 9.98e-5 from its float64 one (past the cap: said so),
    while the same evaluation against an exact reference fails; where the float64 steps raise, the failure stands
    with the reason in its data; 3e-2, past any excuse, fails without the float64 steps being run."""
    import contextlib
    import torch
    from types import SimpleNamespace

    from paracheck.domain.records import Status

    def recorder(delta, after=1.85182):
        held = steps.Recorder()
        held.records = [StepRecord(torch.tensor(1.0), {"e": torch.tensor([delta, 0.0], dtype=torch.float64)})]
        held.evaluated = [1.0, after]
        return held

    body = SimpleNamespace(case=SimpleNamespace(control=None), layout=TfLayout(tp=4), control=None,
                           tol=SimpleNamespace(atol=1e-5, rtol=1e-5), ctx=SimpleNamespace(
                               phase=lambda name: contextlib.nullcontext()),
                           ref=transformers.LlamaForCausalLM(transformers.LlamaConfig(
                               vocab_size=32, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                               num_attention_heads=2)))
    expected, ran = recorder(0.0), []

    def wide(after=1.85182):
        ran.append(True)
        return recorder(2.1e-5, after)

    def judged(delta, exact=wide, after=1.85182):
        first = steps.check(recorder(delta, after), expected, 1e-5, 1e-5)
        assert first.status == Status.FAIL
        return steps._within_own_error(body, first, recorder(delta, after), expected, None, exact)

    excused = judged(1.55e-5)
    assert excused.status == Status.PASS and "own rounding error: e parts by 1.55e-05" in excused.detail
    assert excused.data["reference_error"] == {"step": 1, "parameter": "e", "max_abs": pytest.approx(2.1e-5),
                                               "evaluated": [0.0, 0.0]}
    assert "first_step" not in excused.data and ran == [True]
    sensitive = judged(0.0, lambda: wide(1.85182 + 9.98e-5), after=1.85182 + 2.05e-4)
    assert sensitive.status == Status.PASS and "evaluation loss after" in sensitive.detail
    assert "past what the tolerance can judge" in sensitive.detail
    assert sensitive.data["evaluation_excused"]["after"]["as"] == "beyond"
    exact_there = judged(0.0, lambda: wide(1.85182), after=1.85182 + 2.05e-4)
    assert exact_there.status == Status.FAIL and "evaluation loss after" in exact_there.detail
    ran.clear()

    def raising():
        raise RuntimeError("expected scalar type Double")
    unmeasured = judged(1.55e-5, raising)
    assert unmeasured.status == Status.FAIL and "not_measured" in unmeasured.data["reference_error"]
    planted = judged(3e-2)
    assert planted.status == Status.FAIL and "reference_error" not in planted.data and ran == []  # never run
    # The gate's edge (`_within_reach`): 9e-5 at the first failing step is within the widest excuse (1e-5 + 1e-4), so
    # the float64 steps run (and, the reference 2.1e-5 from them, excuse nothing); 1.2e-4 is past it: they never run.
    assert judged(9e-5).status == Status.FAIL and ran == [True]
    assert judged(1.2e-4).status == Status.FAIL and ran == [True]


def test_a_head_that_hands_its_loss_the_count_is_no_mean_loss_head():
    """The negative control of `tasks._counts_nothing`: a sequence head whose loss call passes `**kwargs` (the
    Trainer's `num_items_in_batch` reaches the loss, which then sums) is not the cause; the same head without them
    is."""
    from paracheck.adapters.transformers import tasks

    class CountingForSequenceClassification(transformers.GPTNeoXForSequenceClassification):
        def forward(self, input_ids=None, labels=None, **kwargs):
            logits = self.score(self.gpt_neox(input_ids).last_hidden_state)
            return self.loss_function(logits=logits, labels=labels, pooled_logits=logits[:, -1], config=self.config,
                                      **kwargs)

    class UncountedForSequenceClassification(transformers.GPTNeoXForSequenceClassification):
        def forward(self, input_ids=None, labels=None, **kwargs):
            logits = self.score(self.gpt_neox(input_ids).last_hidden_state)
            return self.loss_function(logits=logits, labels=labels, pooled_logits=logits[:, -1], config=self.config)

    assert not tasks._counts_nothing(CountingForSequenceClassification.forward)
    assert not steps._mean_loss_head(object.__new__(CountingForSequenceClassification))
    assert tasks._counts_nothing(UncountedForSequenceClassification.forward)
    assert steps._mean_loss_head(object.__new__(UncountedForSequenceClassification))
