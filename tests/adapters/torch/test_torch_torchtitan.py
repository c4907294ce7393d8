"""The torch adapter on what torchtitan-style users write (examples/gpt2_*.py): names read through activation
checkpointing's and torch.compile's wrappers, a bug only training shows localized to its step and module, loss
parallelism, pipeline schedules, and torch's context parallelism where it runs. The names and words in process;
the plans on real gloo ranks, each with its planted bug and the controls."""

import math
import tempfile

import pytest
import torch

from paracheck.adapters.torch import names
from paracheck.checks.grads import compare_grads
from paracheck.domain.localization import ForwardLocalization, GradsLocalization, ModuleRow, StepsLocalization
from paracheck.domain.records import Status
from paracheck.rank.forked import fork_ranks
from paracheck.results.localization import steps_line
from tests.gloo_ranks import answer, answers, gloo_world
from tests.support import run_paracheck
from tests.torch_specs import _GPT2, _example

GPT2 = "examples/gpt2_tp_fsdp.py"
BUGS = "examples/gpt2_tp_fsdp_bug.py"
PIPE = "examples/gpt2_pipeline.py"
CP = "examples/gpt2_context_parallel.py"
SPECS = "tests/torch_specs.py"


# -- in process ----------------------------------------------------------------------------------


def test_names_are_read_through_checkpointing_and_compile_and_a_wrapper_is_not_recorded_twice():
    reference = _GPT2.build()
    wrapped = _GPT2.build()
    _GPT2.apply_ac(wrapped)
    _GPT2.apply_compile(wrapped, "eager")  # nothing compiles until called
    raw = [n for n, _ in wrapped.named_parameters()]
    assert "h.0._orig_mod._checkpoint_wrapped_module.attn.c_k.bias" in raw
    assert list(names.parameters(wrapped)) == list(names.parameters(reference))
    recorded = names.hooked(wrapped)
    assert "h.0" not in recorded and recorded["h.0._orig_mod._checkpoint_wrapped_module"] == "h.0"
    assert sorted(recorded.values()) == sorted(n for n, _ in reference.named_modules())
    whole = torch.compile(reference, backend="eager")  # a compiled root: its inner module is the root
    assert names.hooked(whole)["_orig_mod"] == "" and list(names.parameters(whole))[0] == "wte.weight"


def test_ddp_names_are_read_through_too(one_rank_world):
    """(FSDP1's `_fsdp_wrapped_module` is read the same way, by its class; FSDP1 needs an accelerator to wrap.)"""
    from torch.nn.parallel import DistributedDataParallel

    reference = _GPT2.build()
    ddp = DistributedDataParallel(_GPT2.build())
    assert next(iter(ddp.named_parameters()))[0] == "module.wte.weight"
    assert list(names.parameters(ddp)) == list(names.parameters(reference))
    assert names.hooked(ddp)["module"] == "" and "" not in names.hooked(ddp)


def test_a_child_named_like_a_wrappers_attribute_is_kept_under_a_module_that_wraps_nothing():
    model = torch.nn.Module()
    model.module = torch.nn.Linear(2, 2)  # DDP keeps its module here; a user's module may too
    assert list(names.parameters(model)) == ["module.weight", "module.bias"]


def test_a_parameter_on_one_side_only_is_named_as_that_not_counted_beyond_tolerance():
    same = torch.ones(3)
    result = compare_grads([("a", same, same), ("b", same * 1.1, same)], 1e-5, 1e-5,
                           unmatched={"parallel": ["h.0._checkpoint_wrapped_module.w"], "reference": ["h.0.w"]})
    assert result.status == Status.FAIL
    assert result.detail.startswith("1 parameters in the parallel model only: h.0._checkpoint_wrapped_module.w; "
                                    "1 parameters in the reference only: h.0.w; 1 gradients beyond tolerance: b")
    pattern = result.data["localization"]["grads"]["pattern"]
    assert "h.*._checkpoint_wrapped_module.w: in the parallel model only" in pattern
    clean = compare_grads([("a", same, same)], 1e-5, 1e-5, unmatched={"parallel": [], "reference": []})
    assert clean.status == Status.PASS


@pytest.mark.parametrize("found,words", [
    ({"step": 2, "where": "forward", "origin": "h.0.mlp.c_proj",
      "forward": {"first": {"module": "h.0.mlp.c_proj", "max_abs": 9.6e-3}}},
     "step 2 rerun from where it began: the forward first leaves the reference at h.0.mlp.c_proj (max_abs 9.60e-03)"),
    ({"step": 1, "where": "gradients", "origin": "ln_f.weight", "grads": {"pattern": "ln_f.weight off by 2 = tp"}},
     "step 1 rerun from where it began: the forward agrees; the gradients part, origin ln_f.weight"),
    ({"step": 1, "where": "update", "origin": None},
     "the forward and every gradient agree with the reference's, so the update parts them"),
])
def test_the_steps_finding_in_words(found, words):
    assert words in steps_line(StepsLocalization.from_json(found), ["wte.weight"])


def test_where_a_step_parts_is_the_forward_first_then_the_gradients_then_the_update():
    from paracheck.adapters.torch.steps_localize import where

    first = ForwardLocalization((), ModuleRow("h.0.mlp.c_proj"), origin="h.0.mlp")
    table = GradsLocalization(origin="wte.weight")
    assert where(first, table) == ("forward", "h.0.mlp")
    assert where(ForwardLocalization(()), table) == ("gradients", "wte.weight")
    assert where(ForwardLocalization(()), None) == ("update", None)


# -- real runs -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """One 4-rank world for the checkpointed plan and the 1F1B pipeline with every control (one optimizer step: the
    optimizer loop's controls part at the first), and one for the bias counted tp times (it parts at step 2)."""
    layouts = "tp4,fsdp4,tp2xfsdp2,dp2xfsdp2,pp4,pp2xfsdp2"
    controls = run_paracheck(["--spec", f"{GPT2}:spec_ac", "--spec", f"{PIPE}:spec_1f1b", "--nproc", "4", "--layouts",
                              layouts, "--controls", "--steps", "1", "--quiet"], tmp_path_factory.mktemp("four"))
    bias = run_paracheck(["--spec", f"{BUGS}:spec_bias", "--nproc", "4", "--layouts", "tp2xfsdp2", "--steps", "2",
                          "--quiet"], tmp_path_factory.mktemp("bias"))
    return controls, bias


@pytest.mark.slow
def test_a_checkpointed_plan_passes_every_layout_and_the_controls_fire_through_the_wrapper(four_ranks):
    """torchtitan's order (TP with sequence parallelism, checkpoint_wrapper per block, FSDP2 per block and on the
    root) on every 4-rank layout; each control is detected and localized where it planted, by the names the
    reference has (the shard swap in wte, which precedes every wrapped block)."""
    run = four_ranks[0]
    assert run.code == 0, run.out
    cases = [c for c in run.report["cases"] if c["model"] == "spec_ac"]
    plain = {c["layout"]: c["status"] for c in cases if c["control"] is None and c["status"] != "skip"}
    assert plain == dict.fromkeys(("tp4", "fsdp4", "tp2xfsdp2", "dp2xfsdp2"), "pass"), plain
    statuses = {c["status"] for c in cases if c["control"]}
    assert statuses <= {"detected", "skip"}, run.out
    detected = {(c["layout"], c["control"]) for c in cases if c["status"] == "detected"}
    assert {("tp2xfsdp2", "torch-shard-swap"), ("tp4", "torch-shard-swap"), ("fsdp4", "torch-skip-dp-reduce"),
            ("dp2xfsdp2", "torch-grad-sum"), ("tp4", "torch-decay-twice"), ("fsdp4", "torch-clip-local-norm")} \
        <= detected
    placed = [c for c in cases if c["status"] == "detected" and c["localization"].get("planted")]
    assert all(c["localization"]["planted"]["localized"] for c in placed), [
        (c["layout"], c["control"], c["localization"]["planted"]) for c in placed]
    swap = next(c for c in placed if c["control"] == "torch-shard-swap")
    assert swap["localization"]["planted"]["named"] == "wte"
    # The optimizer loop's own bugs: the rerun step's forward and gradients agree, so the update parts them.
    loop = [c for c in cases if c["status"] == "detected"
            and c["control"] in ("torch-clip-local-norm", "torch-decay-twice")]
    assert loop and all(c["localization"]["steps"]["where"] == "update" for c in loop)


@pytest.mark.slow
def test_two_ranks_compile_loss_parallel_pipelines_and_each_planted_bug(tmp_path):
    """On tp2, fsdp2 and pp2, without training (the 4-rank world trains): per-block compile passes (aot_eager),
    checkpointing before it is torch's declared failure on TP before 2.15 and passes fsdp2; loss_parallel passes
    and the vocabulary-parallel loss on gathered logits is off by log 2; GPipe and interleaved 1F1B pass and a stage that freezes its last block
    fails parity.grads there; context parallelism is a skip naming why; a parallelize that raises names its pass; a
    weight planted inside a checkpointed or a compiled block is localized there, by the reference's names."""
    specs = [f"{SPECS}:gpt2_compile", f"{SPECS}:gpt2_ac_compile", f"{GPT2}:spec_loss_parallel",
             f"{BUGS}:spec_loss_gathered", f"{PIPE}:spec", f"{PIPE}:spec_interleaved", f"{PIPE}:spec_frozen",
             f"{CP}:spec", f"{SPECS}:parallelize_raises", f"{SPECS}:gpt2_ac_late_bug", f"{SPECS}:gpt2_compile_late_bug"]
    # --timeout: compiling takes tens of seconds a case on 2 CPUs shared with other work.
    run = run_paracheck([arg for s in specs for arg in ("--spec", s)] + ["--nproc", "2", "--steps", "0", "--quiet",
                                                                         "--timeout", "600"], tmp_path)
    # Two specs named `spec`: the report names them by file.
    by = {(c["model"].replace("gpt2_pipeline.py:", "pipe:").replace("gpt2_context_parallel.py:", "cp:"),
           c["layout"]): c for c in run.report["cases"] if c["control"] is None}
    assert run.code == 1, run.out
    assert by["gpt2_compile", "tp2"]["status"] == "pass"
    # torch's declared failure (docs/upstream/torch_compile_checkpoint_dtensor.md); torch 2.14.1 and 2.15.0 train it
    # (2.14.0 not measured). The entry has a `message`, so a case it no longer matches is `pass`, never `xpass`.
    fixed = torch.torch_version.TorchVersion(torch.__version__) >= (2, 14, 1)
    assert by["gpt2_ac_compile", "tp2"]["status"] == ("pass" if fixed else "xfail"), by["gpt2_ac_compile", "tp2"]
    assert by["gpt2_ac_compile", "fsdp2"]["status"] == "pass"
    assert by["spec_loss_parallel", "tp2"]["status"] == "pass"
    _assert_loss_on_gathered_logits(by["spec_loss_gathered", "tp2"])
    for name in ("pipe:spec", "spec_interleaved"):
        assert by[name, "pp2"]["status"] == "pass", by[name, "pp2"]
        assert {c["id"] for c in by[name, "pp2"]["checks"] if c["status"] == "pass"} >= {
            "parity.forward", "parity.inference", "parity.loss", "parity.grads", "structure.tp_shards"}
    frozen = {c["id"]: c for c in by["spec_frozen", "pp2"]["checks"]}
    assert by["spec_frozen", "pp2"]["status"] == "fail" and frozen["parity.grads"]["failed_ranks"] == [0]
    assert "h.1.ln_1.weight: gradient missing" in frozen["parity.grads"]["detail"]
    assert frozen["parity.loss"]["status"] == "pass"  # the forward and loss are untouched
    cp = by["cp:spec", "cp2"]
    assert cp["status"] == "skip" and "context_parallel cannot run attention on cpu" in cp["reason"]
    assert "_scaled_dot_product_flash_attention_for_cpu" in cp["reason"] and by["cp:spec", "fsdp2"]["status"] == "pass"
    for name in ("gpt2_ac_late_bug", "gpt2_compile_late_bug"):  # localized by the names the reference has
        forward = by[name, "tp2"]["localization"]["forward"]
        assert (forward["origin"], forward["ranks"], forward["not_compared"]) == ("h.1.mlp.c_proj", [0, 1], []), forward
        order = [m["module"] for m in forward["modules"]]
        assert all(m["within"] for m in forward["modules"][:order.index("h.1.mlp.c_proj")])
    raised = by["parallelize_raises", "tp2"]
    assert raised["status"] == "error" and "parallelize: RuntimeError: plan names a module" in raised["reason"]
    assert [(c["id"], c["status"]) for c in raised["checks"]] == [("structure.mesh", "fail")]


def _assert_loss_on_gathered_logits(case: dict) -> None:
    checks = {c["id"]: c for c in case["checks"]}
    assert case["status"] == "fail" and checks["parity.forward"]["status"] == "pass"
    assert checks["parity.loss"]["status"] == "fail" and checks["parity.grads"]["status"] == "fail"
    assert checks["parity.loss"]["max_abs"] == pytest.approx(math.log(2), rel=1e-5)


def _assert_bias_counted_tp_times(case: dict) -> None:
    """Only parity.steps fails, at step 2 (step 1 moved the zero bias), localized to the module on every rank."""
    checks = {c["id"]: c for c in case["checks"]}
    assert case["status"] == "fail" and {i for i, c in checks.items() if c["status"] == "fail"} == {"parity.steps"}
    assert checks["parity.steps"]["detail"].startswith("step 2 of 2: loss")
    steps = case["localization"]["steps"]
    assert (steps["step"], steps["where"], steps["origin"]) == (2, "forward", "h.0.mlp.c_proj"), steps
    assert steps["forward"]["last_agreeing"]["module"] == "h.0.mlp.c_fc" and steps["ranks"] == [0, 1, 2, 3]


@pytest.mark.slow
def test_four_ranks_train_a_tp_x_fsdp_plan_and_pipelines_take_their_control(four_ranks):
    """tp2xfsdp2 trains (the bias counted tp times printed pass there when the default tier trained one layout per
    kind: which layouts the tier trains is tests/domain/test_training_tier.py's) and fails parity.steps where it arises;
    1F1B passes pp4 and pp2xfsdp2, and the unscaled schedule is detected on both, at <root>."""
    controls, bias = four_ranks
    assert bias.code == 1, bias.out
    _assert_bias_counted_tp_times(bias.report["cases"][0])
    pipe = [c for c in controls.report["cases"] if c["model"] == "spec_1f1b" and c["status"] != "skip"]
    assert {(c["layout"], c["control"], c["status"]) for c in pipe} == {
        (layout, control, status) for layout in ("pp4", "pp2xfsdp2")
        for control, status in ((None, "pass"), ("torch-pp-unscaled", "detected"))}, pipe
    assert all(c["localization"]["planted"]["localized"] for c in pipe if c["control"]), pipe


def _unshard_worker(rank: int, tmp: str) -> None:
    with gloo_world(rank, 2, tmp):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        cp = _example("gpt2_context_parallel.py")
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
        tokens = torch.arange(16).reshape(2, 8)
        local = tokens.clone()
        with context_parallel(mesh, buffers=[local], buffer_seq_dims=[1], no_restore_buffers={local}):
            pass  # torch's own sharding of the buffer (load-balanced); no attention, so it runs on CPU
        answer(tmp, rank, {"local": local.tolist(), "whole": cp.unshard(local, mesh).tolist(),
                           "rank_order": cp.unshard(local, mesh, restore=False).tolist()})


@pytest.mark.slow
def test_the_context_parallel_examples_gather_puts_torchs_load_balanced_shards_back_in_order_and_the_bug_does_not():
    """What the CP example can show on CPU (its attention cannot run here): each rank holds the head and tail chunk
    torch's load balancer gave it, the example's differentiable unshard restores the sequence, and the planted one
    (rank order) permutes it."""
    with tempfile.TemporaryDirectory() as tmp:
        fork_ranks(_unshard_worker, (tmp,), 2, timeout=120)
        got = answers(tmp, 2)
    want = torch.arange(16).reshape(2, 8).tolist()
    assert got[0]["local"] == [[0, 1, 6, 7], [8, 9, 14, 15]]  # head and tail chunks: torch's load balancing
    assert all(g["whole"] == want for g in got) and all(g["rank_order"] != want for g in got)
