"""`results.resume`: which cases a report holds (all but errors; an interrupted run's unfinished ones are not in its
cases), the split of a run's cases into those to run and those carried, and a report that carries them
(`report.to_json`): counted, judged, marked. In process; the real stopped and resumed runs are in test_run.py."""

import json

import pytest
from hypothesis import given, strategies as st

from paracheck.domain.case import Case
from paracheck.adapters.diffusers.layout import DiffusersLayout
from paracheck.results import report, resume
from paracheck.results.runmeta import RunMeta

STATUSES = ["pass", "fail", "error", "skip", "detected", "missed", "inconclusive", "xfail", "xpass"]
CASES = [Case(model, "pkg:f", DiffusersLayout.parse(layout, order), variant=variant, dtype=dtype, control=control,
              library="diffusers")
         for model in ("flux", "wan") for layout in ("u4", "tp2xr2") for order in ("cp-fastest", "tp-fastest")
         for variant in ("base", "uneven") for dtype in ("fp32", "bf16") for control in (None, "backward-only")]


def _entry(case: Case, status: str, route: str = "native") -> dict:
    """A case as a report writes it (the route resolved)."""
    return {"id": case.id_with(), "model": case.model, "layout": case.layout.name, "order": case.layout.order,
            "route": route, "variant": case.variant, "dtype": case.dtype, "cp_options": dict(case.cp_options),
            "control": case.control, "status": status}


@given(st.dictionaries(st.sampled_from(range(len(CASES))), st.sampled_from(STATUSES)))
def test_every_case_is_run_or_carried_and_errors_run_again(tmp_path_factory, statuses):
    path = tmp_path_factory.mktemp("r") / "r.json"
    path.write_text(json.dumps({"cases": [_entry(CASES[i], s) for i, s in statuses.items()]}))
    todo, carried = resume.left(CASES, resume.held(str(path)))
    assert len(todo) + len(carried) == len(CASES)
    held = {i for i, s in statuses.items() if s != "error"}
    assert todo == [c for i, c in enumerate(CASES) if i not in held]
    assert [c["id"] for c in carried] == [CASES[i].id_with() for i in sorted(held)]


def test_the_key_ignores_the_route_the_report_resolved_but_not_the_options():
    case = Case("flux", "pkg:f", DiffusersLayout.parse("u4"), cp_options=(("ulysses_anything", True),), library="diffusers")
    entry = dict(_entry(case, "pass", route="composed"))
    assert resume.left([case], {resume._json_key(entry): entry})[0] == []
    other = dict(entry, cp_options={})
    assert resume.left([case], {resume._json_key(other): other})[0] == [case]


def test_a_sharded_load_is_another_case_than_the_same_layout_in_memory():
    """A pipeline's --all takes one layout both ways: holding one leaves the other to run."""
    case = Case("flux-pipeline", "pkg:f", DiffusersLayout.parse("u4"), library="diffusers")
    loaded = Case("flux-pipeline", "pkg:f", DiffusersLayout.parse("u4"), route="sharded-load", library="diffusers")
    entry = _entry(case, "pass", route="native")
    assert resume.left([case, loaded], {resume._json_key(entry): entry})[0] == [loaded]
    entry = _entry(loaded, "pass", route="sharded-load")
    assert resume.left([case, loaded], {resume._json_key(entry): entry})[0] == [case]


@pytest.mark.parametrize("text", ["", "{}", "[1]", '{"cases": [{"layout": "u4"}]}'])
def test_a_report_that_is_not_one_is_refused_by_name(tmp_path, text):
    path = tmp_path / "r.json"
    path.write_text(text)
    with pytest.raises(resume.ResumeError, match=f"--resume {path}: not a paracheck JSON report"):
        resume.held(str(path))


def test_carried_cases_are_counted_and_judged_and_not_run_ones_named():
    carried = [dict(_entry(CASES[0], "pass")), dict(_entry(CASES[1], "fail"))]
    data = report.to_json([], RunMeta(backend="gloo"), [], carried=carried, not_run=["wan-u4-auto"])
    assert [c["resumed"] for c in data["cases"]] == [True, True]
    assert data["summary"]["passed"] == 1 and data["summary"]["failed"] == 1
    assert data["exit_code"] == 1  # a failure carried from the first run still fails the whole run
    assert data[resume.NOT_RUN] == ["wan-u4-auto"] and data["summary"][resume.NOT_RUN] == 1
    assert report.to_json([], RunMeta(), [], carried=carried[:1])["exit_code"] == 0
