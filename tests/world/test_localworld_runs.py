"""`paracheck run --local-world N` on real diffusers models: every rank's checks in one process, against gloo.

Two small launches (one process each): an 8-rank world no machine here runs with gloo (Flux on three mesh
dimensions, `tp2xr2xu2`), and a 4-rank control compared case for case with the gloo session run (`default_run`).
And in this process: the control only three mesh dimensions can show, on that 8-rank layout; and several cases
in two worlds, counting what the ranks keep (`world.recent`).
"""

import pytest

from tests.support import run_paracheck

#: Checks a local world does not take (`rank.localrun.LATER_OFF`): left out of the comparison with gloo.
LATER = {"parity.steps", "structure.checkpoint", "parity.generate"}


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    return run_paracheck(["--local-world", "8", "--models", "flux", "--layouts", "tp2xr2xu2", "--variants", "base",
                          "--quiet"], tmp_path_factory.mktemp("local8"))


@pytest.fixture(scope="module")
def shard_control(tmp_path_factory):
    return run_paracheck(["--local-world", "4", "--models", "flux", "--layouts", "tp2xu2", "--variants", "base",
                          "--controls", "--only-control", "global-rank-shard-index", "--quiet"],
                         tmp_path_factory.mktemp("local4"), switches={"PARACHECK_LOCALIZE": "0"})


@pytest.mark.slow
def test_flux_on_three_mesh_dimensions_passes_every_check_on_eight_ranks_in_one_process(eight):
    assert eight.code == 0, eight.out
    case = eight.case("flux", "tp2xr2xu2")
    assert case["status"] == "pass", case
    checks = {c["id"]: c for c in case["checks"]}
    for check in ("structure.mesh", "structure.tp_shards", "structure.collectives", "parity.forward",
                  "parity.inference", "parity.grads"):
        assert checks[check]["status"] == "pass", checks[check]
    assert checks["parity.forward"]["max_abs"] < 1e-6  # fp32 on CPU, as on gloo
    assert eight.report["nproc"] == 8
    assert eight.report["local_world"]["ran"] == 1
    assert "local world of 8 ranks in one process: 1 of 1 cases ran" in eight.out


@pytest.mark.slow
def test_a_control_in_one_process_fails_the_same_checks_on_the_same_ranks_as_on_gloo(shard_control, default_run):
    """Cross-validation: the TP shard-index bug (ranks 1 and 2 hold the wrong shards on tp2xu2) gives the same
    status, the same failing checks and ranks, and max_abs within rounding, in one process as on four."""
    assert shard_control.code == 0, shard_control.out
    local = shard_control.case("flux", "tp2xu2", "global-rank-shard-index")
    gloo = default_run.case("flux", "tp2xu2", "global-rank-shard-index")
    assert local["status"] == gloo["status"] == "detected"
    mine = {c["id"]: c for c in local["checks"] if c["id"] not in LATER}
    theirs = {c["id"]: c for c in gloo["checks"] if c["id"] in mine}
    assert set(mine) == set(theirs)
    for check, ours in mine.items():
        other = theirs[check]
        assert (ours["status"], ours["failed_ranks"]) == (other["status"], other["failed_ranks"]), check
        if ours["max_abs"] is not None and other["max_abs"] is not None:
            assert abs(ours["max_abs"] - other["max_abs"]) <= 1e-6 + 1e-5 * abs(other["max_abs"]), check
    assert mine["structure.tp_shards"]["failed_ranks"] == [1, 2]


@pytest.mark.slow
def test_a_pipelines_drift_control_is_planted_on_its_one_rank_in_one_process_as_on_gloo(tmp_path):
    """`drift-grows` scales one rank's attention output from the second step: a Python flag of this rank's was a
    RankDependent skip in a local world (`pipelines/controls.py:100`), where gloo detects it. Now a per-rank factor:
    detected, parity.pipeline failing on ranks 0-3 at the very max_abs gloo gives (5.348e-4, session 20); and the
    pipeline's noise, drawn from a `torch.Generator`, is each rank's own first draw (the stand-in), or the plain
    pass before it would not be exact."""
    run = run_paracheck(["--local-world", "4", "--models", "flux-pipeline", "--layouts", "tp2xu2", "--variants",
                         "base", "--controls", "--only-control", "drift-grows", "--quiet"], tmp_path)
    assert run.code == 0, run.out
    case = run.case("flux-pipeline", "tp2xu2", "drift-grows")
    assert case["status"] == "detected", case
    pipeline = next(c for c in case["checks"] if c["id"] == "parity.pipeline")
    assert pipeline["failed_ranks"] == [0, 1, 2, 3]
    assert abs(pipeline["max_abs"] - 5.348e-4) < 1e-6
    steps = pipeline["data"]["per_rank"]["0"]["steps"]
    assert steps[0]["over"] < 1  # step 1 exact: the drift starts at the second step



@pytest.mark.slow
def test_a_pipelines_per_rank_choices_run_in_one_process_as_on_gloo(tmp_path):
    """Three per-rank choices of the pipeline cases, each a Python value of this rank's that one process cannot hold
    for every rank (session 22, ltx-pipeline and ltx2-pipeline): `guidance-batch-split` sliced sample `index % batch`
    by this rank's CP index (RankDependent at `pipelines/controls.py:167`: counted a local world's limit where gloo
    ran it); the first-block cache's guard (`pipelines/agree.py`) read each rank's change ratio as one float, as
    diffusers' own decision does (`.item()`: an AssertionError inside torch's LocalTensorMode, the plain
    first-block-cache case an `error` here, a pass on gloo); `cache-local-key` chose reuse by a float of its ratio.
    Now the index and the reuse are per-rank tensors and the guard decides once per rank: every case as on gloo
    (`--nproc 2`, session 22), at gloo's figures."""
    run = run_paracheck(["--local-world", "2", "--models", "ltx-pipeline", "--layouts", "r2", "--variants",
                         "first-block-cache", "--controls", "--quiet"], tmp_path)
    assert run.code == 0, run.out

    def pipeline(variant, control=None):
        case = run.case("ltx-pipeline", "r2", control, variant=variant)
        return case, next(c for c in case["checks"] if c["id"] == "parity.pipeline")

    case, check = pipeline("base", "guidance-batch-split")
    assert case["status"] == "detected", case["reason"]
    assert check["failed_ranks"] == [0, 1] and abs(check["max_abs"] - 0.3537031) < 1e-6
    assert check["data"]["per_rank"]["0"]["steps"][0]["over"] > 1  # wrong from the first step, as on gloo
    case, check = pipeline("first-block-cache")
    assert case["status"] == "pass", case["reason"]
    assert check["max_abs"] < 1e-6  # 7.15e-7, gloo's
    case, check = pipeline("first-block-cache", "cache-local-key")
    assert case["status"] == "detected", case["reason"]
    assert check["failed_ranks"] == [0, 1] and abs(check["max_abs"] - 0.0820636) < 1e-6


@pytest.mark.slow  # no launch, but a 8-rank case's compute (about 30 s wall at load 11): kept out of the fast tier
def test_the_collapsed_cp_index_control_is_detected_on_eight_ranks_and_names_ranks_2_to_5(tmp_path):
    """`cp-collapsed-shard-index` applies to no 4-rank layout (it is each rank's own shard there,
    tests/adapters/diffusers/test_controls.py); on flux `tp2xr2xu2` ranks 2-5 read TP coordinate 1 - t and hold
    the other shard. Run in this process as the local world runs a case (`run_local_case`), without the backward:
    the bug's checks are the structure and the forward (the gradients fail too, 1.96, measured)."""
    import os

    import paracheck.fixtures as fixtures
    from paracheck.domain.backends import get_backend
    from paracheck.domain.case import Case
    from paracheck.adapters.diffusers.layout import DiffusersLayout
    from paracheck.domain.records import CaseStatus, CheckId, Status
    from paracheck.domain.registry import get_control
    from paracheck.rank.localrun import run_local_case
    from paracheck.world.localworld import LocalWorld

    name = "cp-collapsed-shard-index"
    case = Case("flux", fixtures.FIXTURES["flux"], DiffusersLayout.parse("tp2xr2xu2"), control=name, grads=False,
                library="diffusers")
    os.makedirs(tmp_path / "refs")
    with LocalWorld(8) as world:
        results = run_local_case(0, case, get_backend("gloo"), world, str(tmp_path / "refs"), str(tmp_path / "case"))
    failing = {r.rank: {c.id for c in r.checks if c.status == Status.FAIL} for r in results}
    assert [rank for rank, ids in failing.items() if CheckId.TP_SHARDS in ids] == [2, 3, 4, 5]
    assert all(CheckId.FORWARD in ids for ids in failing.values())  # every rank: the output is gathered
    forward = [c for c in results[0].checks if c.id == CheckId.FORWARD][0]
    assert forward.max_abs > 1e-2  # 0.113 measured; a pass is below 1e-6
    assert get_control(name).judge(set().union(*failing.values()))[0] == CaseStatus.DETECTED


@pytest.mark.slow  # no launch, but three cases' compute and two references (four cases: 127 s at load 28 on 2 cores)
def test_what_ranks_keep_is_bounded_over_cases_and_dropped_with_the_world(tmp_path):
    """Cases in this one process, as a local world (or the pytest mixins) runs them: what the caches
    hold (`world.recent.held`) never passes each one's bound however many cases run, and the next world starts
    with nothing the last one kept."""
    import paracheck.fixtures as fixtures
    from paracheck.adapters.diffusers.layout import DiffusersLayout
    from paracheck.domain.backends import get_backend
    from paracheck.domain.case import Case
    from paracheck.rank.localrun import run_local_case
    from paracheck.world import recent
    from paracheck.world.localworld import LocalWorld

    backend, refs = get_backend("gloo"), str(tmp_path / "refs")
    (tmp_path / "refs").mkdir()
    cases = [Case("flux", fixtures.FIXTURES["flux"], DiffusersLayout.parse("tp2"), variant=v, grads=False,
                  library="diffusers") for v in ("base", "batch2")]
    seen = []
    with LocalWorld(2) as world:
        for index, case in enumerate(cases):
            results = run_local_case(index, case, backend, world, refs, str(tmp_path / f"case{index}"))
            assert {r.status.value for r in results} == {"ok"}, results[0].reason
            seen.append(recent.held())
    # One reference at most (the last case's: the first was dropped before it was read); a source per variant.
    assert [(h["diffusers reference"], h["diffusers source"]) for h in seen] == [(1, 1), (1, 2)]
    with LocalWorld(2) as world:
        run_local_case(0, cases[1], backend, world, refs, str(tmp_path / "next"))
    held = recent.held()
    # The control: the new world holds its own source and reference only; the last world's are gone.
    assert (held["diffusers source"], held["diffusers reference"]) == (1, 1)
