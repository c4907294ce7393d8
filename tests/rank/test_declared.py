"""A failing case that declared known failures explain whole is not rerun with localization's hooks
(`rank.declared`): decided on a real one-rank gloo world, with every way it must still rerun, and carried into the
case's localization and the report's lines (`results.localization`)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paracheck.domain.case import Case, Route
from paracheck.adapters.diffusers.layout import DiffusersLayout
from paracheck.domain.records import CheckId, CheckResult, RankResult, RankStatus, Status
from paracheck.rank import declared
from paracheck.results import known, localization
from paracheck.results.known import KnownFailure

RING = KnownFailure(reason="ring backward rotates the wrong way", model="flux", layout="r4", check="parity.grads")


@pytest.fixture
def world(one_rank_world):
    return None


@pytest.fixture(autouse=True)
def entries(monkeypatch):
    monkeypatch.delenv("PARACHECK_LOCALIZE", raising=False)
    yield
    declared.use([])


def _case(model="flux", layout="r4") -> Case:
    return Case(model, "diffusers:flux", DiffusersLayout.parse(layout), library="diffusers")


def _result() -> RankResult:
    return RankResult(0, 0, RankStatus.OK, route=Route.NATIVE, model_class="FluxTransformer2DModel")


def _checks(*failing: CheckId) -> list[CheckResult]:
    ids = (CheckId.FORWARD, CheckId.INFERENCE, CheckId.GRADS)
    return [CheckResult(i, Status.FAIL if i in failing else Status.PASS) for i in ids]


def test_a_failure_its_entry_declares_is_not_rerun(world):
    declared.use(known.as_data([RING]))
    assert declared.explained(_case(), _result(), _checks(CheckId.GRADS)) == RING.reason


def test_an_entry_listing_checks_covers_each_of_them(world):
    listed = KnownFailure(reason="per-shard conversion", model="flux", layout="r4",
                          check=("parity.forward", "parity.grads"))
    declared.use(known.as_data([listed]))
    assert declared.explained(_case(), _result(), _checks(CheckId.GRADS, CheckId.FORWARD)) == listed.reason
    assert declared.explained(_case(), _result(), _checks(CheckId.GRADS, CheckId.INFERENCE)) is None


def test_an_undeclared_check_failing_beside_it_is_rerun(world):
    declared.use(known.as_data([RING]))
    assert declared.explained(_case(), _result(), _checks(CheckId.GRADS, CheckId.FORWARD)) is None


def test_an_entry_for_another_case_or_with_a_message_does_not_count(world):
    worded = KnownFailure(reason="x", model="flux", layout="r4", check="parity.grads", message="*accumulator*")
    declared.use(known.as_data([worded, RING]))
    assert declared.explained(_case(layout="r2"), _result(), _checks(CheckId.GRADS)) is None
    declared.use(known.as_data([worded]))
    assert declared.explained(_case(), _result(), _checks(CheckId.GRADS)) is None


def test_an_entry_with_a_site_counts_where_every_check_it_names_failed_there(world):
    """A typed entry (`site`, hunyuan_vl's `reference:rows_depend_on_batch`) spares the rerun where each check it
    names failed at that site on this rank; a failure left untyped (or typed otherwise) is rerun."""
    from paracheck.domain.records import Failure, FailureKind

    typed = KnownFailure(reason="rows coupled", model="flux", layout="r4", check=("parity.forward", "parity.grads"),
                         site="reference:rows_*")

    def failing(*sites):
        checks = _checks(CheckId.FORWARD, CheckId.GRADS)
        for check, site in zip([c for c in checks if c.status == Status.FAIL], sites):
            check.failure = Failure(FailureKind.CHECK, check.id, site=site) if site is not None else None
        return checks

    declared.use(known.as_data([typed]))
    assert declared.explained(_case(), _result(), failing("reference:rows_depend_on_batch",
                                                          "reference:rows_depend_on_batch")) == typed.reason
    assert declared.explained(_case(), _result(), failing("reference:rows_depend_on_batch", None)) is None
    assert declared.explained(_case(), _result(), failing("reference:rows_depend_on_batch", "compare.x")) is None


def test_an_entry_matched_on_the_resolved_route_is_held_to_it(world):
    composed = KnownFailure(reason="composed only", model="flux", layout="r4", check="parity.grads", route="composed")
    declared.use(known.as_data([composed]))
    assert declared.explained(_case(), _result(), _checks(CheckId.GRADS)) is None  # this rank resolved native


def test_localize_all_reruns_declared_failures_too(world, monkeypatch):
    declared.use(known.as_data([RING]))
    monkeypatch.setenv("PARACHECK_LOCALIZE", "all")
    assert declared.explained(_case(), _result(), _checks(CheckId.GRADS)) is None


def test_a_case_no_entry_may_meet_takes_no_collective():
    # No process group is up here: an all-reduce would raise.
    declared.use(known.as_data([RING]))
    assert declared.explained(_case(model="wan"), _result(), _checks(CheckId.GRADS)) is None


def test_the_reason_reaches_the_cases_localization_and_the_report():
    checks = _checks(CheckId.GRADS)
    declared.not_rerun(checks, RING.reason)
    merged = localization.merge({c.id: [(0, c)] for c in checks})
    assert RING.reason in merged.not_run and "PARACHECK_LOCALIZE=all" in merged.not_run
    assert merged.not_run in localization.note(merged)
    assert "localization" not in checks[0].data  # the passing checks say nothing


_DECLARABLE = ("parity.forward", "parity.inference", "parity.grads")


@st.composite
def _entries_and_failing(draw):
    """Entries meeting the case (each "*", one check or several, in file order) and the checks that failed."""
    checks = st.one_of(st.just("*"), st.sampled_from(_DECLARABLE),
                       st.lists(st.sampled_from(_DECLARABLE), min_size=2, max_size=3, unique=True).map(tuple))
    entries = [KnownFailure(reason=f"entry {i}", model="flux", layout="r4", check=check)
               for i, check in enumerate(draw(st.lists(checks, max_size=4)))]
    return entries, draw(st.sets(st.sampled_from((CheckId.FORWARD, CheckId.INFERENCE, CheckId.GRADS)), min_size=1))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_entries_and_failing())
def test_the_rank_and_the_verdict_explain_a_failure_by_the_same_entries(world, drawn):
    """The rank's rerun decision (`declared.explained`, after its all-reduce) and the verdict's xfail
    (`known.explaining`) read one rule (`known.explaining_entries`): for any entries and failing checks, the rank
    skips the rerun exactly where the verdict is explained, naming the same entries' reasons. They differed where
    a "*" entry met a case beside a per-check one (the rank named both, the last "*"; the verdict the first alone)."""
    from paracheck.results.verdict import Verdict, merge_check
    from paracheck.domain.records import CaseStatus

    entries, failing = drawn
    declared.use(known.as_data(entries))
    rank = declared.explained(_case(), _result(), _checks(*failing))
    checks = [merge_check(c.id, [(0, c)]) for c in _checks(*failing)]
    verdict = Verdict(_case(), CaseStatus.FAIL, Route.NATIVE, checks=checks, model_class="FluxTransformer2DModel")
    host = "; ".join(e.reason for e in known.explaining(verdict, entries)) or None
    assert rank == host


@given(site=st.text(alphabet="abc:_.*", max_size=8), held=st.one_of(st.none(), st.text(alphabet="abc:_.", max_size=8)))
def test_an_entrys_site_is_one_glob_over_the_typed_failure(site, held):
    """`KnownFailure.site_matches`, which the rank's rerun decision and the verdict's declaration both ask: "*"
    matches any failure or none; another site matches only a failure typed at a site the glob takes."""
    import fnmatch

    from paracheck.domain.records import Failure, FailureKind

    entry = KnownFailure(reason="r", model="flux", site=site or "*")
    failure = None if held is None else Failure(FailureKind.CHECK, CheckId.FORWARD, site=held)
    expected = entry.site == "*" or (held is not None and fnmatch.fnmatchcase(held, entry.site))
    assert entry.site_matches(failure) == expected
