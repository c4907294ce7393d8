"""checkpoint.roundtrip for the transformers adapter: the layout a checkpoint is loaded back on (in process, over
layouts), then real gloo worlds: the plain cases' parts, and each checkpoint control detected with every older
check of its case as the plain case has it."""

import dataclasses
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from paracheck.adapters.transformers import cases as tf_cases  # noqa: E402
from paracheck.adapters.transformers.layout import SHARDING, TfLayout, layouts_for, refusals, reload_layout  # noqa: E402
from tests.support import run_paracheck  # noqa: E402

CHECKPOINT = "checkpoint.roundtrip"
#: (control, model, layout, world): each checkpoint control where this file plants it.
CHECKPOINT_PLANTED = [("tf-save-local-shard", "llama", "tp2", 2), ("tf-pp-local-names", "llama", "pp2", 2),
                      ("tf-dcp-skip-mesh-dim", "llama", "tp2xfsdp2", 4), ("tf-resume-drops-optimizer", "llama", "tp2", 2)]

worlds = st.sampled_from([2, 4, 8])


@given(worlds, st.booleans(), st.data())
def test_the_reload_layout_is_another_buildable_layout_of_the_world(world, moe, data):
    layout = data.draw(st.sampled_from(layouts_for(world, moe)))
    rows = data.draw(st.sampled_from([0, 1, 2, 4, 8]))
    other = reload_layout(layout, world, moe, rows=rows)
    if other is None:
        return
    assert other != layout and other.world == world and not refusals(other, moe)
    assert any(getattr(other, t) != getattr(layout, t) for t in SHARDING)
    assert not rows or rows % other.dp == 0
    assert not (other.pp > 1 and other.tp > 1)  # raises while loading upstream
    assert other.pp == 1 or layout.pp > 1  # a pipeline only where the checkpoint came from one


@pytest.mark.parametrize("name,world,rows,expected", [("tp4", 4, 2, "tp2xfsdp2"), ("fsdp4", 4, 4, "tp2xfsdp2"),
                                                      ("tp2xfsdp2", 4, 2, "tp4"), ("pp4", 4, 2, "tp2xfsdp2"),
                                                      ("pp2", 2, 2, "fsdp2"), ("pp2", 8, 2, "pp8")])
def test_reload_layouts_the_issue_names(name, world, rows, expected):
    assert reload_layout(TfLayout.parse(name), world, rows=rows).name == expected


def test_a_world_with_one_layout_has_none_to_reload_on():
    assert reload_layout(TfLayout.parse("tp2"), 2, rows=1) is None  # fsdp2 needs 2 rows, pp2 no pipeline source


# -- real gloo worlds ---------------------------------------------------------------------------------


def _parts(check) -> dict:
    """Each part's status on every rank: part -> {statuses}."""
    per_rank = check["data"]["per_rank"]
    return {part: {r["parts"][part]["status"] for r in per_rank.values()} for part in "abcde"}


def _older(case) -> dict:
    """The checks older than the round trip that a checkpoint control also runs (a control that cannot show in
    generation skips the generate pass, so parity.generate is the plain case's alone)."""
    return {c["id"]: c["status"] for c in case["checks"] if c["id"] not in (CHECKPOINT, "parity.generate")}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """llama on tp2 and pp2 with every control that applies (tf-save-local-shard on tp2; tf-pp-local-names on
    pp2 cannot be judged beside its plain case, see below), and tf-pp-local-names alone."""
    run = run_paracheck(["--models", "llama", "--layouts", "tp2,pp2", "--nproc", "2", "--steps", "0", "--controls"],
                        tmp_path_factory.mktemp("two"))
    alone = run_paracheck(["--models", "llama", "--layouts", "pp2", "--nproc", "2", "--steps", "0", "--controls",
                           "--only-control", "tf-pp-local-names"], tmp_path_factory.mktemp("alone"))
    return run, alone


@pytest.mark.slow
def test_a_tensor_parallel_checkpoint_round_trips_every_part(two_ranks):
    run, _ = two_ranks
    case = run.case("llama", "tp2")
    check = run.check("llama", "tp2", CHECKPOINT)
    assert case["status"] == "pass" and check["status"] == "pass", check["detail"]
    assert _parts(check) == {p: {"pass"} for p in "abcde"}
    assert check["max_abs"] < 1e-5  # measured: saves and loads exact, logits 2e-7, resumed steps ~1e-6
    assert all(r["reload_layout"] == "fsdp2" for r in check["data"]["per_rank"].values())
    assert "Trainer(save_strategy='steps') refuses this model" in check["detail"]


@pytest.mark.slow
def test_the_gathered_save_control_is_detected_by_part_a_and_passes_every_older_check(two_ranks):
    run, _ = two_ranks
    control = run.case("llama", "tp2", "tf-save-local-shard")
    check = run.check("llama", "tp2", CHECKPOINT, "tf-save-local-shard")
    assert control["status"] == "detected", control["reason"]
    assert check["failed_ranks"] == [0, 1] and check["detail"].startswith("failing (a): ")
    assert "safetensors shape(s) differ" in check["detail"]
    assert set(_older(control).values()) == {"pass"} and _older(control) == _older(run.case("llama", "tp2"))


@pytest.mark.slow
def test_a_resume_that_drops_the_optimizer_state_is_detected_by_part_e_alone(two_ranks):
    """The weights load right ((a) to (d) pass); the step after the load, from a fresh optimizer, does not
    (measured here, tp2 -> fsdp2: 39 parameters differ, max_abs 1.4e-4 against atol 1e-5)."""
    run, _ = two_ranks
    control = run.case("llama", "tp2", "tf-resume-drops-optimizer")
    check = run.check("llama", "tp2", CHECKPOINT, "tf-resume-drops-optimizer")
    assert control["status"] == "detected", control["reason"]
    assert _parts(check) == {"a": {"pass"}, "b": {"pass"}, "c": {"pass"}, "d": {"pass"}, "e": {"fail"}}
    assert check["failed_ranks"] == [0, 1] and "step 2 of 2" in check["detail"], check["detail"]
    assert _older(control) == _older(run.case("llama", "tp2"))


@pytest.mark.slow
def test_the_pipeline_gathered_save_is_declared_and_the_sharded_parts_pass(two_ranks):
    run, _ = two_ranks
    plain = run.case("llama", "pp2")
    check = run.check("llama", "pp2", CHECKPOINT)
    assert plain["status"] == "xfail" and "rank 0's stage only" in plain["reason"], plain["reason"]
    assert check["detail"].startswith("failing (a): the safetensors lack 20 of")
    assert _parts(check) == {"a": {"fail"}, "b": {"pass"}, "c": {"pass"}, "d": {"pass"}, "e": {"refused"}}
    assert "refuses save_pretrained(distributed_checkpoint=True) on pp2" in " ".join(
        n for r in check["data"]["per_rank"].values() for n in r["notes"])
    # The kit's rule: a control is not judged where its plain case fails what it must trip.
    assert run.case("llama", "pp2", "tf-pp-local-names")["status"] == "inconclusive"


@pytest.mark.slow
def test_the_local_names_control_is_detected_by_the_sharded_parts_the_plain_case_passes(two_ranks):
    run, alone = two_ranks
    control = alone.case("llama", "pp2", "tf-pp-local-names")
    assert control["status"] == "detected", control["reason"]
    parts = _parts(alone.check("llama", "pp2", CHECKPOINT, "tf-pp-local-names"))
    assert parts["b"] == {"fail"} and parts["c"] == parts["d"] == {"blocked"}
    assert _parts(run.check("llama", "pp2", CHECKPOINT))["b"] == {"pass"}
    assert _older(control) == _older(run.case("llama", "pp2"))  # parity.loss fails upstream in both


@pytest.mark.slow
def test_the_skip_mesh_dim_control_is_detected_on_a_two_dimensional_mesh():
    """One 4-rank world: the plain tp2xfsdp2 case with its checkpoint pass, and the control, whose load raises
    nothing (keys and shapes right) and leaves wrong shards."""
    from paracheck.domain.backends import get_backend
    from paracheck.launch.launcher import Launcher
    from paracheck.results import known
    from paracheck.results.verdict import judge_controls, merge

    cases = [dataclasses.replace(tf_cases.expand("llama", "tp2xfsdp2", 4, ["base"], only_control=control)[0]
                                 if control else tf_cases.expand("llama", "tp2xfsdp2", 4, ["base"])[0],
                                 checkpoint=True) for control in (None, "tf-dcp-skip-mesh-dim")]
    outcome = Launcher(get_backend("gloo"), 4, 600).run(cases)
    assert not outcome.events, outcome.events
    plain, control = [merge(c, outcome.results[i]) for i, c in enumerate(cases)]
    known.apply([plain, control], known.load(known.SHIPPED))
    judge_controls([plain, control])
    assert plain.status.value == "pass", plain.reason
    assert control.status.value == "detected", control.reason
    check = control.check(next(c.id for c in control.checks if c.id.value == CHECKPOINT))
    assert check.failed_ranks == [0, 1, 2, 3] and check.detail.startswith("failing (c): ")
    older = {c.id: c.status for c in control.checks if c.id.value != CHECKPOINT}
    assert older == {c.id: c.status for c in plain.checks if c.id.value != CHECKPOINT}
    assert set(s.value for s in older.values()) == {"pass"}


def test_the_other_layout_is_one_the_models_sizes_take():
    """A user's tiny config with 2 heads takes tp2 but not tp4: the reload layout is chosen among those it fits."""
    from paracheck.adapters.transformers.layout import TfLayout, reload_layout

    unfitted = reload_layout(TfLayout.parse("tp2xfsdp2"), 4)
    assert unfitted.name == "fsdp4"
    fitted = reload_layout(TfLayout.parse("tp2xfsdp2"), 4, fits=lambda other: other.name != "fsdp4")
    assert fitted is not None and fitted.name not in ("fsdp4", "tp2xfsdp2")


def test_an_optimizer_load_is_typed_as_untrained_state_only_where_every_missing_key_is_an_untrained_parameters():
    """The declared upstream optimizer load (docs/upstream/transformers_optimizer_load_unused_params.md) is keyed by a
    typed site, not the message: only where each missing state names a parameter that got no gradient."""
    from paracheck.adapters.transformers.checkpoint import _untrained_only

    said = ("Missing key in checkpoint state_dict: optimizer.state.model.post_layernorm.weight.exp_avg. "
            "Missing key in checkpoint state_dict: optimizer.state.model.layers.1.fc.bias.step.")
    untrained = {"model.post_layernorm.weight", "model.layers.1.fc.bias"}
    assert _untrained_only(RuntimeError(said), untrained)
    assert not _untrained_only(RuntimeError(said), {"model.post_layernorm.weight"})  # a trained one's state lost
    assert not _untrained_only(RuntimeError("Missing key in checkpoint state_dict: model.x"), untrained)


def _agreeing(rank: int, tmp: str) -> None:
    """Rank 0 raised in a part and asks whether its peer did too: first the peer raised too, then it is elsewhere, as
    MiniCPM5-MoE's fourth rank was, inside the unit mesh's collective the others had left."""
    import time

    import torch.distributed as dist

    from paracheck.adapters.transformers.checkpoint import agreement_group, peers_raised_too
    from tests.gloo_ranks import answer

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("cpu:gloo", store=dist.FileStore(os.path.join(tmp, "store"), 2), rank=rank, world_size=2)
    agreement_group()  # as a roundtrip makes it, on every rank (the kit's worlds are "cpu:gloo")
    both = peers_raised_too("c", seconds=30)
    apart = peers_raised_too("c" if rank == 0 else "d", seconds=30)  # each raised, in different parts
    if rank == 0:
        alone = peers_raised_too("c", seconds=1)
    else:
        time.sleep(2)  # past rank 0's wait, never at its barrier
        alone = None
    answer(tmp, rank, [both, apart, alone])
    dist.destroy_process_group()


def test_a_part_raised_on_some_ranks_only_ends_the_case_instead_of_hanging(tmp_path):
    """A checkpoint part's raise is that part's failure only where every rank raised it; where a peer did not come
    to the agreement, `peers_raised_too` says so within its wait, and the part re-raises (the case ends as a pass's
    raise does) instead of going on to a barrier the peer never reaches: the sweep's minicpm5_moe dpr4 hung there."""
    from paracheck.rank.forked import fork_ranks
    from tests.gloo_ranks import answers

    fork_ranks(_agreeing, (str(tmp_path),), 2, timeout=60)
    assert answers(str(tmp_path), 2) == [[True, False, False], [True, False, None]]
