"""The report's groupings (`results.grouping`), one for every renderer: a verdict and its JSON read into the same
row, so the terminal notes and the HTML report group alike; and the grouping rules themselves."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from paracheck.domain.case import Case
from paracheck.adapters.diffusers.layout import DiffusersLayout
from paracheck.domain.records import CaseStatus, Failure, FailureKind, Route
from paracheck.results.grouping import Row, groups
from paracheck.results.verdict import Verdict

LAYOUTS = [DiffusersLayout.parse(n) for n in ("tp2", "u4", "r4", "tp2xu2")]


@st.composite
def verdicts(draw) -> list[Verdict]:
    out = []
    for _ in range(draw(st.integers(0, 12))):
        case = Case(draw(st.sampled_from(["flux", "wan"])), "paracheck.fixtures:flux", draw(st.sampled_from(LAYOUTS)),
                    control=draw(st.sampled_from([None, None, "skip-cp-hooks"])),
                    variant=draw(st.sampled_from(["base", "uneven"])), dtype=draw(st.sampled_from(["fp32", "bf16"])),
                    library="diffusers")
        status = draw(st.sampled_from([CaseStatus.PASS, CaseStatus.SKIP, CaseStatus.XFAIL, CaseStatus.XPASS]))
        plan = draw(st.sampled_from(["", "_cp_plan"])) if status == CaseStatus.SKIP else ""
        out.append(Verdict(case, status, draw(st.sampled_from([Route.NATIVE, Route.SHARDED_LOAD])),
                           reason=draw(st.sampled_from(["r1", "r2"])),
                           known=draw(st.sampled_from([None, "entry a"])) if status.value.startswith("x") else None,
                           failure=Failure(FailureKind.SKIP, missing_plan=plan) if plan else None))
    return out


@settings(max_examples=60, deadline=None)
@given(verdicts())
def test_a_verdict_and_its_json_read_into_the_same_row_and_group_alike(vs):
    from_verdicts = [Row.of_verdict(i, v) for i, v in enumerate(vs)]
    from_json = [Row.of_verdict(i, Verdict.from_json(v.to_json())) for i, v in enumerate(vs)]
    assert from_verdicts == from_json
    assert groups(from_verdicts) == groups(from_json)


@settings(max_examples=60, deadline=None)
@given(verdicts())
def test_every_xfail_and_every_plain_skip_is_in_exactly_one_group(vs):
    rows = [Row.of_verdict(i, v) for i, v in enumerate(vs)]
    found = groups(rows)
    grouped = [r.index for g in found if g.kind in ("xfail", "xpass", "skip") for r in g.rows]
    expected = [r.index for r in rows if r.status in ("xfail", "xpass") or
                (r.status == "skip" and not r.control and not r.missing_plan)]
    assert sorted(grouped) == sorted(expected)
    for g in found:
        if g.kind == "never":  # each model's layouts once, whatever the variants
            assert len(set(g.layouts)) == len(g.layouts)


def _row(i, model="flux", layout="u4", control=None, status="skip", reason="r", missing_plan=None):
    return Row(i, f"c{i}", model, "base", "fp32", layout, "native", control, status, reason, None, missing_plan,
               (model, layout, "cp-fastest", "native", "base", "fp32"))


def test_a_control_of_a_skipped_plain_case_folds_into_it_and_one_skipped_alone_is_listed_by_control():
    rows = [_row(0), _row(1, control="c1"), _row(2, layout="r4", status="pass"), _row(3, layout="r4", control="c1",
                                                                                        reason="control only")]
    found = groups(rows)
    assert [(g.kind, g.title) for g in found] == [("skip", "r"), ("skip-controls", "control only")]
    assert [r.index for r in found[0].rows] == [0] and found[1].controls == (("c1", ("flux",)),)


def test_models_that_lack_the_same_plan_for_the_same_layouts_share_one_never_line():
    rows = [_row(0, missing_plan="_cp_plan"), _row(1, model="wan", missing_plan="_cp_plan"),
            _row(2, layout="r4", missing_plan="_cp_plan"), _row(3, model="wan", layout="r4", missing_plan="_cp_plan")]
    [never] = groups(rows)
    assert never.never_line == "flux, wan: no _cp_plan, so u4, r4 cannot run"
