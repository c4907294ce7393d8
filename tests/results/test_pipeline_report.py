"""What a report shows of a run, pure and in process: the run at a glance (`results.overview`), a loop's pictures and
step curve (`results.loopview`), and what a case's checks lift to its JSON (`results.verdict.lifted`)."""

from __future__ import annotations

import re

from hypothesis import given, strategies as st

from paracheck.domain.case import Case
from paracheck.adapters.diffusers.layout import DiffusersLayout
from paracheck.domain.lifted import LoopFigures
from paracheck.domain.records import TO_CASE, CheckId, CheckResult, RankResult, RankStatus, Status
from paracheck.results import html, loopview, overview
from paracheck.results.verdict import lifted, merge

STATUSES = list(overview.ORDER)
#: A 1x1 black PNG, base64.
PIXEL = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAAAAAA6fptVAAAACklEQVR4nGNgAAAAAgAB4iG8MwAAAABJRU5ErkJggg==")


@given(st.lists(st.sampled_from(STATUSES), min_size=1))
def test_a_cell_shows_the_status_that_needs_a_look_first(statuses):
    shown = overview.cell_status(statuses)
    assert shown in statuses
    assert all(overview.ORDER.index(shown) <= overview.ORDER.index(s) for s in statuses)


_case = st.fixed_dictionaries({"model": st.sampled_from(["flux", "wan", "flux-pipeline"]),
                               "layout": st.sampled_from(["u2", "tp2", "r2"]),
                               "status": st.sampled_from(STATUSES), "id": st.text(max_size=8)})


@given(st.lists(_case, max_size=12))
def test_the_grid_has_a_cell_per_model_and_layout_each_linking_to_a_case_of_it(cases):
    page = html.render({"cases": cases}, with_plots=False)
    if not cases:
        assert 'id="grid"' not in page
        return
    models, layouts, held = overview.cells([c.row for c in html.read({"cases": cases})])
    grid = page[page.index('id="grid"'):page.index("</table>", page.index('id="grid"'))]
    assert grid.count('<tr><th scope="row">') == len(models)
    assert grid.count('class="cell c-') == len(held)
    anchors = set(re.findall(r'<tr class="case[^"]*" id="([^"]+)"', page))
    for target in re.findall(r'class="cell c-[^"]+" data-model="[^"]*" data-layout="[^"]*"><a href="#([^"]+)"', grid):
        assert target in anchors


def test_the_grid_keeps_the_runs_order_and_links_the_worst_case():
    cases = [{"model": "a", "layout": "u2", "status": "pass", "id": "a-u2"},
             {"model": "b", "layout": "tp2", "status": "pass", "id": "b-tp2"},
             {"model": "a", "layout": "u2", "status": "fail", "id": "a-u2-x"}]
    page = html.render({"cases": cases}, with_plots=False)
    grid = page[page.index('id="grid"'):]
    assert grid.index(">a<") < grid.index(">b<") and grid.index(">u2<") < grid.index(">tp2<")
    cell = re.search(r'data-model="a" data-layout="u2"><a href="#([^"]+)" title="([^"]+)">fail', grid)
    assert cell and "a-u2-x" in cell.group(1) and cell.group(2) == "a u2: 1 fail, 1 pass"


def _steps(values, bound=1e-5):
    return [{"max_abs": v, "bound": bound, "over": (v / bound) if isinstance(v, float) else None} for v in values]


@given(st.lists(st.one_of(st.none(), st.floats(0, 1e3), st.just(float("nan")), st.just(float("inf"))), max_size=9))
def test_the_step_curve_draws_any_figures(values):
    svg = loopview.curve_svg(LoopFigures.from_lifted({"steps": _steps(values)}).steps, "p")
    assert svg.startswith(("<svg", "<p"))
    drawn = [v for v in values if v is not None]
    if any(v > 0 and v == v and v != float("inf") for v in drawn):
        assert svg.count("<circle") == len(values)


def test_a_case_with_pictures_and_steps_opens_to_them():
    case = {"model": "flux-pipeline", "layout": "u2", "status": "pass", "id": "flux-pipeline-u2-native", "rank": 1,
            "steps": _steps([1e-7, 2e-5, 4e-5]),
            "images": {"reference": PIXEL, "parallel": PIXEL, "difference": PIXEL, "height": 1, "width": 1,
                       "max_abs": 2e-3, "scale": 500.0}}
    page = html.render({"cases": [case]}, with_plots=False)
    assert 'class="case row-pass expandable"' in page
    assert page.count('src="data:image/png;base64,') == 3
    assert 'width="160" height="160"' in page  # a 1x1 picture, enlarged with its pixels square
    assert "parallel (rank 1, the worst)" in page and "x500" in page
    assert page.count('class="beyond"') == 2 and page.count('class="within"') == 1


def test_a_picture_that_is_not_base64_text_is_left_out():
    images = {"reference": "<script>", "parallel": PIXEL, "height": 2, "width": 2}
    page = html.render({"cases": [{"model": "m", "layout": "u2", "status": "pass", "images": images}]},
                       with_plots=False)
    assert "<script>\"" not in page and page.count("data:image/png") == 1


def _rank(rank: int, status: Status, max_abs: float, tag: str) -> RankResult:
    check = CheckResult(CheckId.PIPELINE, status, max_abs=max_abs,
                        data={"steps": [max_abs], TO_CASE: {"steps": [{"max_abs": max_abs}], "images": {"tag": tag}}})
    return RankResult(0, rank, RankStatus.OK, checks=[check])


def test_a_case_lifts_the_failing_ranks_figures_and_keeps_each_ranks_curve():
    ranks = [_rank(0, Status.PASS, 5e-3, "r0"), _rank(1, Status.FAIL, 1e-3, "r1"), _rank(2, Status.FAIL, 2e-3, "r2")]
    assert lifted(ranks)["images"] == {"tag": "r2"} and lifted(ranks)["rank"] == 2
    case = Case("flux-pipeline", "f:x", DiffusersLayout.parse("r4"), library="diffusers")
    data = merge(case, ranks).to_json()
    assert data["images"] == {"tag": "r2"} and data["rank"] == 2 and data["steps"] == [{"max_abs": 2e-3}]
    per_rank = data["checks"][0]["data"]["per_rank"]
    assert {r: d["steps"] for r, d in per_rank.items()} == {"0": [5e-3], "1": [1e-3], "2": [2e-3]}
    assert all(TO_CASE not in d for d in per_rank.values())


def test_what_a_check_lifts_never_replaces_the_cases_own_fields():
    rank = _rank(0, Status.FAIL, 1.0, "r0")
    rank.checks[0].data[TO_CASE]["status"] = "pass"
    case = Case("m", "f:x", DiffusersLayout.parse("u2"), library="diffusers")
    assert merge(case, [rank]).to_json()["status"] == "fail"


def test_what_a_case_lifted_that_is_not_the_schemas_reads_as_absent():
    """Another version's report: a step that is no object is left out, a figure that is no number, a rank that is no
    integer and pictures that are no object read as absent; nothing raises."""
    found = LoopFigures.from_lifted({"steps": [3, {"max_abs": "x", "bound": 1e-5}], "images": 4, "rank": True})
    assert [(s.max_abs, s.bound) for s in found.steps] == [(None, 1e-5)] and found.pictures is None
    assert found.rank is None and found and not LoopFigures.from_lifted({"images": [1], "steps": "x"})
