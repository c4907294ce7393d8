"""Merging rank results into verdicts, the control rules, and known failures: pure, in process."""

import json

import pytest
from hypothesis import given, settings, strategies as st

from paracheck.results import known
from paracheck.domain.case import Case
from paracheck.adapters.diffusers.layout import DiffusersLayout
from paracheck.domain.localization import Localization
from paracheck.domain.records import (BEYOND_PRECISION, CaseStatus, CheckId, CheckResult, Failure, FailureKind,
                                      Finding, MergedCheck, RankResult, RankStatus, Route, Status)
from tests.domain.test_localization import localizations
from paracheck.results.verdict import (LayoutName, Verdict, inconclusive_rule, judge, judge_controls, merge,
                                       outcome_for_test)

U4 = DiffusersLayout.parse("u4")


def _case(control=None, model="flux", layout=U4):
    return Case(model, "paracheck.fixtures:flux", layout, control=control, library="diffusers")


def _ranks(statuses_by_check: dict, world=4, status=RankStatus.OK):
    """One RankResult per rank; `statuses_by_check[check]` lists the ranks where it fails."""
    out = []
    for rank in range(world):
        checks = [CheckResult(c, Status.FAIL if rank in bad else Status.PASS, "bad" if rank in bad else "",
                              max_abs=1e-2 if rank in bad else 1e-7) for c, bad in statuses_by_check.items()]
        out.append(RankResult(0, rank, status, route=Route.NATIVE, checks=checks))
    return out


def test_merge_names_failing_ranks_and_worst_figure():
    v = merge(_case(), _ranks({CheckId.FORWARD: [1, 3], CheckId.MESH: []}))
    forward = v.check(CheckId.FORWARD)
    assert v.status == CaseStatus.FAIL and forward.failed_ranks == [1, 3] and forward.max_abs == 1e-2
    assert forward.detail_rank == 1 and v.id == "flux-u4-native"


def test_findings_are_grouped_by_message():
    ranks = _ranks({CheckId.FORWARD: []})
    for r in ranks:
        r.findings = ["split will not be applied"]
    assert [(f.message, f.ranks) for f in merge(_case(), ranks).findings] == [("split will not be applied", [0, 1, 2, 3])]


@given(st.sets(st.sampled_from([CheckId.CP_HOOKS, CheckId.PROCESSOR_CONFIG, CheckId.FORWARD])))
def test_control_detected_iff_every_must_trip_check_failed(failing):
    v = merge(_case("skip-cp-hooks"), _ranks({c: ([0] if c in failing else []) for c in CheckId
                                               if c != CheckId.COLLECTIVES}))
    must = {CheckId.CP_HOOKS, CheckId.PROCESSOR_CONFIG}
    assert v.status == (CaseStatus.DETECTED if must <= failing else CaseStatus.MISSED)


def test_secondary_ranks_do_not_hide_the_cause():
    ranks = [RankResult(0, 0, RankStatus.ERROR, reason="was waiting on rank 1", secondary=True),
             RankResult(0, 1, RankStatus.ERROR, reason="RuntimeError: boom", traceback="tb")]
    v = merge(_case(), ranks)
    assert v.status == CaseStatus.ERROR and v.cause_ranks == [1] and v.secondary_ranks == [0]
    assert v.reason.startswith("rank 1: RuntimeError: boom; rank 0 was waiting on it")


@pytest.mark.parametrize("status, failing, must_trip, expected", [
    (CaseStatus.FAIL, [CheckId.GRADS], (CheckId.GRADS,), True),
    (CaseStatus.XFAIL, [CheckId.GRADS], (CheckId.GRADS,), True),
    (CaseStatus.XFAIL, [CheckId.GRADS], (CheckId.FORWARD,), False),   # r4's known grads bug: forward controls judge
    (CaseStatus.ERROR, [CheckId.FORWARD], (CheckId.MESH,), True),     # a raise leaves nothing to judge against
    (CaseStatus.PASS, [], (CheckId.GRADS,), False),
    (CaseStatus.XPASS, [], (CheckId.GRADS,), False),
])
def test_inconclusive_rule(status, failing, must_trip, expected):
    plain = merge(_case(), _ranks({CheckId.FORWARD: [0] if CheckId.FORWARD in failing else [],
                                   CheckId.GRADS: [0] if CheckId.GRADS in failing else []}))
    plain.status = status
    assert inconclusive_rule(plain, must_trip) == expected


def test_a_control_of_a_failing_case_is_inconclusive_never_missed():
    plain = merge(_case(), _ranks({CheckId.FORWARD: [0, 1, 2, 3], CheckId.GRADS: [1]}))
    control = merge(_case("backward-only"), _ranks({CheckId.FORWARD: [0, 1, 2, 3], CheckId.GRADS: []}))
    assert control.status == CaseStatus.MISSED
    judge_controls([plain, control])
    assert control.status == CaseStatus.INCONCLUSIVE and "does not pass parity.grads" in control.reason
    assert outcome_for_test(control, ())[0] == "skip"


def test_a_control_is_still_judged_on_checks_its_plain_case_passes():
    plain = merge(_case(), _ranks({CheckId.FORWARD: [0, 1, 2, 3], CheckId.GRADS: []}))
    control = merge(_case("backward-only"), _ranks({CheckId.FORWARD: [0, 1, 2, 3], CheckId.GRADS: []}))
    judge_controls([plain, control])
    assert control.status == CaseStatus.MISSED


ENTRY = known.KnownFailure(reason="ring backward", model="flux", layout="r*", check="parity.grads")


def test_known_failure_turns_a_matching_failure_into_xfail():
    v = merge(_case(layout=DiffusersLayout.parse("r4")), _ranks({CheckId.FORWARD: [], CheckId.GRADS: [0, 1, 2, 3]}))
    known.apply([v], [ENTRY])
    assert v.status == CaseStatus.XFAIL and v.known == "ring backward"
    assert outcome_for_test(v, (CheckId.GRADS,))[0] == "xfail" and outcome_for_test(v, (CheckId.FORWARD,))[0] == "pass"


def test_a_rank_that_died_is_not_declared_by_the_check_its_waiting_peers_failed():
    """Seen once in the suite (helios r2xu2): rank 1 died by SIGABRT in the backward, ranks 0 and 3 raised in
    parity.grads when their gloo peer went away, and the case was declared xfail by the Helios gradient entry.
    The death is the failure, and no check entry declares it; the cause's own failing check still is."""
    from paracheck.domain.records import Failure, FailureKind

    entry = known.KnownFailure(reason="helios grads", model="flux", layout="r*", check="parity.grads")
    ranks = _ranks({CheckId.FORWARD: [], CheckId.GRADS: [0, 3]}, status=RankStatus.ERROR)
    for r in ranks:
        r.secondary, r.reason = r.rank != 1, "lost a peer"
    died = RankResult(0, 1, RankStatus.ERROR, reason="rank 1 died by signal SIGABRT",
                      failure=Failure(FailureKind.EXIT, exception="SIGABRT"))
    v = merge(_case(layout=DiffusersLayout.parse("r4")), [ranks[0], died, ranks[2], ranks[3]])
    assert v.failure.kind == FailureKind.EXIT and v.cause_ranks == [1]
    known.apply([v], [entry])
    assert v.status == CaseStatus.ERROR, v.reason
    # The cause failing the declared check itself (every rank's backward raising alike) is still declared.
    alike = merge(_case(layout=DiffusersLayout.parse("r4")), _ranks({CheckId.FORWARD: [], CheckId.GRADS: [0, 1, 2, 3]},
                                                          status=RankStatus.ERROR))
    known.apply([alike], [entry])
    assert alike.status == CaseStatus.XFAIL, alike.reason


def test_known_failure_that_passes_is_xpass():
    v = merge(_case(layout=DiffusersLayout.parse("r4")), _ranks({CheckId.FORWARD: [], CheckId.GRADS: []}))
    known.apply([v], [ENTRY])
    assert v.status == CaseStatus.XPASS and "remove the entry" in v.reason


LISTED = known.KnownFailure(reason="per-shard conversion", model="flux", layout="r*",
                            check=("parity.forward", "parity.grads"))


def test_an_entry_listing_checks_declares_each_and_no_other(tmp_path):
    """One entry naming a list of checks explains any of them failing, alone or together, as one entry each
    naming one would; a check outside the list still fails the case; a pass of the listed checks is xpass."""
    path = tmp_path / "k.toml"
    path.write_text('[[known]]\nmodel = "flux"\nlayout = "r*"\ncheck = ["parity.forward", "parity.grads"]\n'
                    'reason = "per-shard conversion"\n')
    assert known.load(str(path)) == [LISTED]
    r4 = DiffusersLayout.parse("r4")
    for failing in ({CheckId.FORWARD: [0]}, {CheckId.GRADS: [1]}, {CheckId.FORWARD: [0], CheckId.GRADS: [0, 1]}):
        v = merge(_case(layout=r4), _ranks({CheckId.FORWARD: [], CheckId.GRADS: [], **failing}))
        known.apply([v], [LISTED])
        assert v.status == CaseStatus.XFAIL and v.known == "per-shard conversion", failing
    other = merge(_case(layout=r4), _ranks({CheckId.FORWARD: [0], CheckId.INFERENCE: [0]}))
    known.apply([other], [LISTED])
    assert other.status == CaseStatus.FAIL
    passed = merge(_case(layout=r4), _ranks({CheckId.GRADS: []}))  # forward did not run: grads' pass says enough
    known.apply([passed], [LISTED])
    assert passed.status == CaseStatus.XPASS
    ranks = _ranks({CheckId.FORWARD: [], CheckId.GRADS: []})
    for r in ranks:  # grads skipped on every rank (--no-grads): forward's pass says enough
        r.checks = [CheckResult(c.id, Status.SKIP) if c.id == CheckId.GRADS else c for c in r.checks]
    skipped = merge(_case(layout=r4), ranks)
    known.apply([skipped], [LISTED])
    assert skipped.status == CaseStatus.XPASS, skipped.reason
    assert known.KnownFailure(**json.loads(json.dumps(known.as_data([LISTED])))[0]) == LISTED  # run.json's way


def test_known_failure_does_not_cover_another_check_or_layout():
    other_check = merge(_case(layout=DiffusersLayout.parse("r4")), _ranks({CheckId.FORWARD: [0], CheckId.GRADS: []}))
    other_layout = merge(_case(), _ranks({CheckId.GRADS: [0]}))
    known.apply([other_check, other_layout], [ENTRY])
    assert other_check.status == CaseStatus.FAIL and other_layout.status == CaseStatus.FAIL


@given(st.sets(st.sampled_from(known.INPUT_TRAITS)), st.sets(st.sampled_from(known.INPUT_TRAITS)))
def test_known_failure_keyed_on_what_the_inputs_carry(required, carried):
    """An entry naming `inputs` covers any case whose inputs carry them, whatever its variant is called."""
    entry = known.KnownFailure(reason="mask bug", layout="r*", check="parity.forward", inputs=tuple(sorted(required)))
    ranks = _ranks({CheckId.FORWARD: [0, 1, 2, 3]})
    for r in ranks:
        r.inputs = sorted(carried)
    v = merge(_case(layout=DiffusersLayout.parse("r4")), ranks)
    known.apply([v], [entry])
    assert (v.status == CaseStatus.XFAIL) == (required <= carried)


def test_known_failures_file_errors_name_the_entry(tmp_path):
    bad = tmp_path / "k.toml"
    bad.write_text('[[known]]\nmodel = "flux"\ncheck = "parity.nope"\nreason = "x"\n')
    with pytest.raises(known.KnownFailuresError, match="entry 1: check 'parity.nope' must be a check id, a non"):
        known.load(str(bad))
    for listed, rule in (('[]', "non-empty list"), ('["parity.grads", "*"]', "non-empty list of check ids"),
                         ('["parity.grads", "parity.grads"]', "names parity.grads twice")):
        bad.write_text(f'[[known]]\nmodel = "flux"\ncheck = {listed}\nreason = "x"\n')
        with pytest.raises(known.KnownFailuresError, match=f"entry 1: check .* {rule}"):
            known.load(str(bad))
    bad.write_text('[[known]]\ninputs = ["masked"]\nreason = "x"\n')
    with pytest.raises(known.KnownFailuresError, match="entry 1: inputs \\['masked'\\] must be a list of mask, padded"):
        known.load(str(bad))
    bad.write_text('[[known]]\nmodell = "flux"\nreason = "x"\n')
    with pytest.raises(known.KnownFailuresError, match="unknown key"):
        known.load(str(bad))
    assert known.load("none") == []


def test_shipped_known_failures_load():
    """Every entry the shipped file declares loads, each with its reason (an empty file would declare none), but
    one fixed in the installed release: the torch compile-of-a-checkpointed-TP-block entry holds before 2.14.1."""
    import torch
    from packaging.version import Version

    with open(known.SHIPPED) as handle:
        lines = [line.strip() for line in handle]
    declared, with_fix = lines.count("[[known]]"), sum(line.startswith("fixed_in = ") for line in lines)
    entries = known.load(known.SHIPPED)
    assert declared >= 5 and sum(not e.fixed_in for e in entries) == declared - with_fix
    assert all(e.reason.strip() for e in entries)
    compile_ckpt = [e for e in entries if e.library == "torch" and "checkpoint_wrapper" in e.reason]
    assert (compile_ckpt == []) == (Version(torch.__version__.split("+")[0]) >= Version("2.14.1"))


def test_an_entry_fixed_in_the_installed_release_is_left_out(tmp_path):
    """`fixed_in` keeps a declaration for older releases only: on the release that fixed it, the case must pass
    plainly (inkling2's TP load, fixed in transformers 5.25.0, was an xpass there)."""
    entries = tmp_path / "k.toml"
    rows = {"old": "pytest 1.0", "future": "pytest 999.0", "absent": "no-such-distribution-here 1.0", "none": ""}
    entries.write_text("".join(f'[[known]]\nmodel = "{name}"\nreason = "x"\n' + (f'fixed_in = "{fixed}"\n' if fixed
                                                                                 else "") for name, fixed in rows.items()))
    assert [e.model for e in known.load(str(entries))] == ["future", "absent", "none"]
    entries.write_text('[[known]]\nreason = "x"\nfixed_in = "transformers"\n')
    with pytest.raises(known.KnownFailuresError, match="entry 1: fixed_in 'transformers' must be a distribution and a"):
        known.load(str(entries))


def test_skips_group_by_the_missing_plan_whatever_the_reason_says():
    from paracheck.results import report
    from paracheck.domain.records import Failure, FailureKind

    verdicts = []
    for model, reason in (("wan", "WanTransformer3DModel has no _tp_plan"), ("ltx", "reworded: no TP plan here")):
        skip = [RankResult(0, r, RankStatus.SKIP, reason, failure=Failure(FailureKind.SKIP, missing_plan="_tp_plan"))
                for r in range(4)]
        verdicts.append(merge(_case(model=model, layout=DiffusersLayout.parse("tp2xu2")), skip))
    assert all(v.never and v.failure.missing_plan == "_tp_plan" for v in verdicts)
    assert report.notes(verdicts, {}) == "never wan, ltx: no _tp_plan, so tp2xu2 cannot run"


def test_a_failing_case_carries_its_first_failing_checks_identity():
    v = merge(_case(), _ranks({CheckId.FORWARD: [1], CheckId.GRADS: [1]}))
    assert v.status == CaseStatus.FAIL and v.failure.kind.value == "check" and v.failure.check == CheckId.FORWARD


def test_judging_case_by_case_agrees_with_judging_the_whole_run():
    """Progress judges one case at a time (keeping the plain verdicts so far), `run` judges all at once:
    both go through `judge`, so a control after its known-failing plain case is inconclusive in both."""
    from paracheck.results.verdict import judge

    r4 = DiffusersLayout.parse("r4")
    cases = [_case(layout=r4), _case("backward-only", layout=r4)]
    results = [_ranks({CheckId.FORWARD: [], CheckId.GRADS: [0, 1, 2, 3]}),
               _ranks({CheckId.FORWARD: [0, 1, 2, 3], CheckId.GRADS: []})]
    whole = judge(cases, results, [ENTRY])
    plain_so_far: dict = {}
    one_by_one = [judge([c], [r], [ENTRY], plain_so_far)[0] for c, r in zip(cases, results)]
    assert [v.status for v in whole] == [v.status for v in one_by_one] == [CaseStatus.XFAIL, CaseStatus.INCONCLUSIVE]
    assert list(plain_so_far) == [cases[0]]


def test_xfails_group_by_their_known_failure_its_reason_once():
    """One line per known failure and the cases it covers, model x layouts, as skips are grouped: the
    ring-backward reason is printed once however many cases it explains."""
    from paracheck.results import report

    ring = known.KnownFailure("ring backward rotates the wrong way", layout="*r4*", check="parity.grads",
                              upstream="lib 1.0")
    mask = known.KnownFailure("the mask is not rotated", model="qwen*", check="parity.forward")
    cases = [_case(model=m, layout=DiffusersLayout.parse(l)) for m, l in (("flux", "r4"), ("flux", "tp2xr4"),
                                                                 ("wan", "r4"), ("qwenimage", "u4"))]
    results = [_ranks({CheckId.FORWARD: [], CheckId.GRADS: [0, 1, 2, 3]})] * 3 + [_ranks({CheckId.FORWARD: [2]})]
    from paracheck.results.verdict import judge

    verdicts = judge(cases, results, [ring, mask])
    assert [v.status for v in verdicts] == [CaseStatus.XFAIL] * 4
    lines = report.notes(verdicts, {}).splitlines()
    assert lines == ["xfail ring backward rotates the wrong way [lib 1.0]", "      flux: r4, tp2xr4; wan: r4",
                     "xfail the mask is not rotated", "      qwenimage: u4"]


def test_a_pass_beyond_the_references_precision_is_said_and_an_excused_one_is_not():
    """A steps check that passed only where the single-device reference was itself too imprecise to judge it
    (`records.BEYOND_PRECISION`, set by `checks.steps`' "beyond", on a step or an evaluation) gets a note line naming
    it, whatever its case's status; one within the plain excuse does not (its detail is in the report)."""
    from paracheck.results import report

    def passing(data: dict):
        ranks = _ranks({})
        for r in ranks:
            r.checks = [CheckResult(CheckId.STEPS, Status.PASS, "at step 3 of 3 the float32 reference is itself ...",
                                    max_abs=1.2e-4, data=dict(data))]
        return merge(_case(layout=DiffusersLayout.parse("tp4")), ranks)

    lines = report.notes([passing({"beyond_step": 3, BEYOND_PRECISION: True})], {}).splitlines()
    assert lines == ["note  flux tp4 native: parity.steps passed only within the reference's own imprecision: "
                     "at step 3 of 3 the float32 reference is itself ..."]
    evaluation = passing({"evaluation_excused": {"after": {"as": "beyond"}}, BEYOND_PRECISION: True})
    assert "parity.steps passed only within" in report.notes([evaluation], {})
    assert report.notes([passing({"steps": [{"excused": {"w": {}}}]}),
                         passing({"evaluation_excused": {"after": {"as": "excused"}}})], {}) == ""


def test_covered_names_a_route_only_where_one_model_runs_a_layout_by_several():
    from paracheck.results.grouping import Row, covered

    tp4 = DiffusersLayout.parse("tp4")
    native, loaded = merge(_case(layout=tp4), _ranks({CheckId.GRADS: [0]})), merge(_case(layout=tp4), _ranks({}))
    loaded.route = Route.SHARDED_LOAD
    uneven = merge(Case("flux", "paracheck.fixtures:flux", U4, variant="uneven", dtype="bf16", library="diffusers"), _ranks({}))
    wan = merge(_case(model="wan", layout=U4), _ranks({}))
    rows = [Row.of_verdict(i, v) for i, v in enumerate([native, loaded, uneven, wan])]
    assert covered(rows) == "flux: tp4 native, tp4 sharded-load; flux uneven bf16, wan: u4"


# -- a verdict written to JSON and read back ---------------------------------------------------------

_words = st.text(max_size=6)
_ranks_drawn = st.lists(st.integers(0, 7), max_size=3)
_figure = st.none() | st.floats(-1e6, 1e6)
_json_values = st.recursive(st.none() | st.booleans() | st.integers(-9, 9) | _words,
                            lambda inner: st.lists(inner, max_size=2) | st.dictionaries(_words, inner, max_size=2),
                            max_leaves=4)
_failures = st.none() | st.builds(Failure, st.sampled_from(list(FailureKind)),
                                  st.none() | st.sampled_from(list(CheckId)), _words, _words, _words, _words)
_merged = st.builds(MergedCheck, st.sampled_from(list(CheckId)), st.sampled_from(list(Status)), _ranks_drawn, _figure,
                    _figure, _figure, _figure, _words, st.none() | st.integers(0, 7),
                    st.dictionaries(_words, _json_values, max_size=2), _failures,
                    st.dictionaries(_words, st.booleans(), max_size=2))
_cases = st.builds(lambda model, layout, order, route, control, variant, dtype, options: Case(
    model, "x:make", LayoutName(layout, order), route, control, variant=variant, dtype=dtype,
    cp_options=tuple(options.items()), library="diffusers"),
    _words, _words, st.sampled_from(["cp-fastest", "tp-fastest"]), st.sampled_from(list(Route)), st.none() | _words,
    _words, _words, st.dictionaries(_words, st.booleans() | st.integers(0, 3), max_size=2))
#: What checks lift to a case (`records.TO_CASE`): fields that are not the verdict's own.
_lifted = st.dictionaries(st.sampled_from(["steps", "images", "rank"]) | _words.map("x_".__add__), _json_values,
                          max_size=3)


@st.composite
def _verdicts(draw):
    floats = st.lists(st.floats(0, 1e4), max_size=3)
    return Verdict(
        draw(_cases), draw(st.sampled_from(list(CaseStatus))), draw(st.sampled_from(list(Route))), draw(_words),
        draw(st.lists(_merged, max_size=3)), draw(st.lists(_words, max_size=2)),
        draw(st.lists(st.builds(Finding, _words, _ranks_drawn), max_size=2)), draw(_ranks_drawn), draw(_ranks_drawn),
        draw(_words), draw(st.dictionaries(st.integers(0, 7), _words, max_size=2)), draw(st.none() | _words),
        draw(_failures), draw(st.none() | _words), draw(st.floats(0, 1e4)), None, draw(st.lists(_words, max_size=2)),
        draw(st.dictionaries(_words, st.floats(0, 1e4), max_size=2)), draw(floats), draw(floats), draw(floats),
        draw(st.lists(st.integers(0, 99), max_size=3)), draw(st.lists(st.integers(0, 99), max_size=3)),
        draw(st.just(Localization()) | localizations), draw(_lifted))


@settings(max_examples=30, deadline=None)
@given(_verdicts())
def test_a_verdict_written_and_read_back_writes_the_same_json(v):
    """`Verdict.from_json(v.to_json()).to_json() == v.to_json()`, through a JSON document too (the report's file)."""
    written = v.to_json()
    assert Verdict.from_json(written).to_json() == written
    through = json.loads(json.dumps(written))
    assert json.dumps(Verdict.from_json(through).to_json(), sort_keys=True) == json.dumps(through, sort_keys=True)


def test_a_report_case_that_is_not_the_schemas_reads_as_absent():
    """Another version's report, or a hand-edited one: nothing raises; what is no field of ours reads as absent."""
    v = Verdict.from_json({"status": "weird", "route": 3, "model": None, "layout": 4, "checks": [
        {"id": "parity.new", "status": "fail"}, {"id": "parity.forward", "status": "odd"}, 7,
        {"id": "parity.grads", "status": "fail", "failed_ranks": [1, "x", True], "max_abs": "big", "facets": 3,
         "failure": {"kind": "new-kind"}}], "failure": {"kind": "check", "check": "parity.new", "site": [1]},
        "stacks": {"1": "tb", "x": "y", "2": 3}, "seconds": "slow", "peak_rss_mb": "x", "findings": ["unparsed", 3]})
    assert v.status == CaseStatus.ERROR and v.route == Route.AUTO and v.case.model == "" and v.case.layout.name == "4"
    [grads] = v.checks
    assert (grads.id, grads.failed_ranks, grads.max_abs, grads.facets, grads.failure) == (CheckId.GRADS, [1], None, {},
                                                                                           None)
    assert v.failure == Failure(FailureKind.CHECK) and v.stacks == {1: "tb"} and v.seconds == 0.0
    assert v.peak_rss_mb == [] and v.findings == [] and v.lifted == {}


def test_findings_a_report_words_alone_are_read_back_with_their_ranks():
    """A report written before `findings_seen` carries each finding as a line; it is read back whole."""
    line = "input not split on ranks 0-2,5: Expected input tensor to have 2 dimensions: split will not be applied."
    [found] = Verdict.from_json({"status": "pass", "findings": [line]}).findings
    assert (found.ranks, found.message) == ([0, 1, 2, 5], line.split(": ", 1)[1])
    v = Verdict.from_json({"status": "pass", "findings": [line]})
    assert v.to_json()["findings"] == [line] and v.to_json()["findings_seen"] == [found.to_json()]


RAISES = known.KnownFailure(reason="upstream backward raises", model="flux", layout="u*", check="error",
                            message="*boom upstream*")


def _raising(failing: dict, message: str = "RuntimeError: boom upstream") -> list:
    """Every rank raising `message` after the checks in `failing` ran (ranks listed fail)."""
    ranks = _ranks(failing, status=RankStatus.ERROR)
    for r in ranks:
        r.reason = message
    return ranks


@pytest.mark.parametrize("failing, message, expected", [
    ({CheckId.CP_HOOKS: [0], CheckId.PROCESSOR_CONFIG: [1]}, "boom upstream", CaseStatus.DETECTED),
    ({CheckId.CP_HOOKS: [], CheckId.PROCESSOR_CONFIG: [1]}, "boom upstream", CaseStatus.MISSED),
    ({CheckId.CP_HOOKS: [0]}, "boom upstream", CaseStatus.INCONCLUSIVE),  # processor_config never ran
    ({CheckId.CP_HOOKS: [0], CheckId.PROCESSOR_CONFIG: [1]}, "another raise", CaseStatus.ERROR),  # undeclared
])
def test_a_control_raising_its_plain_cases_declared_failure_is_judged_on_its_checks(failing, message, expected):
    """The plain case raises a declared upstream failure after its checks passed; a control raising the same is
    judged on the checks it must trip that ran before the raise, never a kit error; another raise stays one."""
    plain_ranks = _raising({CheckId.CP_HOOKS: [], CheckId.PROCESSOR_CONFIG: []})
    control_ranks = _raising(failing, f"RuntimeError: {message}")
    cases = [_case(), _case("skip-cp-hooks")]
    plain, control = judge(cases, [plain_ranks, control_ranks], [RAISES])
    assert plain.status == CaseStatus.XFAIL
    assert control.status == expected, control.reason
    if expected != CaseStatus.ERROR:
        assert "declared upstream failure (rank 0: RuntimeError: boom upstream" in control.reason


def test_a_check_entry_worded_on_its_checks_detail_declares_the_plain_case_a_control_raised_in():
    """The plain case fails forward with a detail a worded `parity.forward` entry declares; its control fails what
    it must trip, then raises that declared failure: the entry is matched on its check's detail, not the case's
    reason, so the control is judged on its checks (it was an error when the entry was matched on the reason)."""
    worded = known.KnownFailure(reason="forward bug", model="flux", layout="u*", check="parity.forward",
                                message="*upstream forward bug*")
    hooks = known.KnownFailure(reason="hooks", model="flux", layout="u*", check=("structure.cp_hooks",
                                                                               "structure.processor_config"))

    def ranks(failing: dict, raised: str = "") -> list:
        out = _ranks(failing, status=RankStatus.ERROR if raised else RankStatus.OK)
        for r in out:
            r.checks = [CheckResult(c.id, c.status, "upstream forward bug" if c.status == Status.FAIL else "",
                                    max_abs=c.max_abs) if c.id == CheckId.FORWARD else c for c in r.checks]
            r.reason = raised or r.reason
        return out

    plain = ranks({CheckId.CP_HOOKS: [], CheckId.PROCESSOR_CONFIG: [], CheckId.FORWARD: [0]})
    control = ranks({CheckId.CP_HOOKS: [0], CheckId.PROCESSOR_CONFIG: [1], CheckId.FORWARD: [0]}, "RuntimeError: x")
    plain, control = judge([_case(), _case("skip-cp-hooks")], [plain, control], [worded, hooks])
    assert plain.status == CaseStatus.XFAIL and control.status == CaseStatus.DETECTED, control.reason


def test_a_control_whose_ranks_died_stays_an_error_beside_a_failing_plain_case():
    """Seen on transformers 5.23 (gemma3 dpr2 tf-decay-twice): both ranks died by SIGSEGV, and the control read
    `inconclusive` because its plain case was xfail. A death is the case's verdict, whatever its plain case."""
    from paracheck.domain.records import Failure, FailureKind

    plain = _ranks({CheckId.CP_HOOKS: [], CheckId.PROCESSOR_CONFIG: [0]})
    died = [RankResult(1, r, RankStatus.ERROR, reason=f"rank {r} died by signal SIGSEGV",
                       failure=Failure(FailureKind.EXIT, exception="SIGSEGV")) for r in range(4)]
    entry = known.KnownFailure(reason="procs", model="flux", check="structure.processor_config")
    plain, control = judge([_case(), _case("skip-cp-hooks")], [plain, died], [entry])
    assert plain.status == CaseStatus.XFAIL and control.status == CaseStatus.ERROR, control.reason
    assert "SIGSEGV" in control.reason


def test_a_control_raising_what_only_another_entry_declares_stays_an_error():
    """An entry that explains the control's raise but not its plain case's (a broad `error` one) must not excuse a
    plant that raised: only the plain case's own declared failure does."""
    broad = known.KnownFailure(reason="another upstream raise", model="flux", layout="u*", check="error",
                               message="*another raise*")
    plain_ranks = _raising({CheckId.CP_HOOKS: [], CheckId.PROCESSOR_CONFIG: []})
    control_ranks = _raising({CheckId.CP_HOOKS: [0], CheckId.PROCESSOR_CONFIG: [1]}, "RuntimeError: another raise")
    plain, control = judge([_case(), _case("skip-cp-hooks")], [plain_ranks, control_ranks], [RAISES, broad])
    assert plain.status == CaseStatus.XFAIL and control.status == CaseStatus.ERROR, control.reason


@pytest.mark.parametrize("raised_by, check, expected", [
    ("library", CheckId.PROCESSOR_CONFIG, CaseStatus.DETECTED),  # the bug's own effect, in a pass it must trip
    ("kit", CheckId.PROCESSOR_CONFIG, CaseStatus.ERROR),  # the planter's own raise: the kit's bug, never hidden
    ("library", CheckId.FORWARD, CaseStatus.ERROR),  # a pass the control does not trip: not its detection
])
def test_a_control_whose_bug_makes_the_library_raise_in_a_pass_it_must_trip_is_judged(raised_by, check, expected):
    """Qwen3-Omni's placeholders on a shard: the ranks holding no placeholder raise in the library (its deepstack
    indexes the features by the bent mask), the rank holding them all waits. The raise fails the pass's check on
    those ranks, which decides detection; a raise in the kit's own code, or in a pass the control does not trip,
    stays an error."""
    ranks = _ranks({CheckId.CP_HOOKS: [0, 1, 2, 3], CheckId.PROCESSOR_CONFIG: [1, 2, 3]}, status=RankStatus.ERROR)
    ranks[0].secondary, ranks[0].reason = True, "was waiting on rank 1"
    for r in ranks[1:]:
        r.reason = "inference: RuntimeError: The size of tensor a (0) must match the size of tensor b (2)"
        r.failure = Failure(FailureKind.RAISE, check, "RuntimeError", "modeling_x.forward", raised_by=raised_by)
    control = merge(_case("skip-cp-hooks"), ranks)
    assert control.status == expected, control.reason


def test_a_check_the_librarys_raise_kept_from_running_is_not_read_as_passing():
    """The raise in the first pass the control must trip keeps the next from running (Qwen3-Omni: inference
    raised, forward never ran): detected on what ran, never `missed` for what could not run."""
    ranks = _ranks({CheckId.CP_HOOKS: [1, 2, 3]}, status=RankStatus.ERROR)
    ranks[0].secondary, ranks[0].reason = True, "was waiting on rank 1"
    for r in ranks[1:]:
        r.failure = Failure(FailureKind.RAISE, CheckId.CP_HOOKS, "RuntimeError", raised_by="library")
    control = merge(_case("skip-cp-hooks"), ranks)
    assert control.status == CaseStatus.DETECTED, control.reason
    assert "the library raised there on ranks 1-3" in control.reason and "processor_config never ran" in control.reason
    ranks[1].checks[0] = CheckResult(CheckId.CP_HOOKS, Status.PASS)  # a rank where it ran and passed: judged as ever
    ranks[1].checks += [CheckResult(CheckId.PROCESSOR_CONFIG, Status.PASS)]
    assert merge(_case("skip-cp-hooks"), ranks).status == CaseStatus.MISSED


def test_a_raise_is_blamed_on_the_innermost_frame_outside_torch_and_pythons_own_modules():
    """`Failure.raised_by`: "kit" where that frame is paracheck's (torch's or the standard library's frames below it
    skipped), "library" otherwise: the judgement above trusts it to keep a planter's own bug an error."""
    import os

    import paracheck
    from paracheck.domain.records import raised_by

    def defined(path: str, body: str):
        namespace = {"torch": __import__("torch"), "json": json}
        exec(compile(f"def f():\n    {body}\n", path, "exec"), namespace)
        return namespace["f"]

    def caught(call):
        try:
            call()
        except Exception as exc:  # whatever it raised: only its traceback is read
            return raised_by(exc.__traceback__)

    kit = os.path.join(os.path.dirname(paracheck.__file__), "adapters", "torch", "controls.py")  # kit, not torch
    elsewhere = os.path.join(os.sep, "elsewhere", "transformers", "modeling_x.py")
    assert caught(defined(kit, "raise KeyError('position_ids')")) == "kit"
    assert caught(defined(kit, "torch.nn.functional.pad(torch.ones(1), (5, 5), mode='reflect')")) == "kit"
    assert caught(defined(kit, "json.loads('{')")) == "kit"  # the standard library's frames are skipped too
    assert caught(defined(elsewhere, "torch.nn.functional.pad(torch.ones(1), (5, 5), mode='reflect')")) == "library"
    assert caught(defined(elsewhere, "raise KeyError('x')")) == "library"


def test_a_hang_is_declared_only_by_an_entry_that_names_it():
    """A hang (which, declared, does not break the run) is explained by an entry whose message or site names it, never
    by a catch-all entry for the family's raises (`check = "error"` with no message), which would hide a new deadlock."""
    from paracheck.domain.records import Failure, FailureKind

    def hung():
        ranks = [RankResult(0, r, RankStatus.ERROR, reason="hung past --timeout 6s in distributed_c10d.py:2169",
                            failure=Failure(FailureKind.HANG, site="utils.get_unit_mesh")) for r in range(4)]
        return merge(_case(), ranks)

    catch_all = known.KnownFailure(reason="the family raises", model="flux", check="error")
    named = known.KnownFailure(reason="unit mesh", model="flux", check="error", message="*hung past --timeout*")
    typed = known.KnownFailure(reason="unit mesh", model="flux", check="error", site="utils.get_unit_mesh")
    for entries, status in (([catch_all], CaseStatus.ERROR), ([named], CaseStatus.XFAIL), ([typed], CaseStatus.XFAIL)):
        v = hung()
        assert v.failure.kind == FailureKind.HANG
        known.apply([v], entries)
        assert v.status == status, (entries, v.reason)
