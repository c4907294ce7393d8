"""The HTML report, in process: a real run's page and a hand-built failing case's, parsed with html.parser
(rows, filters, plots, nothing fetched), `paracheck report` and its errors, and pages from any report."""

from __future__ import annotations

import json
import math
import re
from html.parser import HTMLParser

import pytest
from hypothesis import given, settings, strategies as st

from paracheck.cli.main import main
from paracheck.domain.localization import ForwardLocalization, GradsLocalization, Localization
from paracheck.results import html, plots
from tests.html_sample import FIRST, MODULES, localization, sample

needs_matplotlib = pytest.mark.skipif(not plots.available(), reason="matplotlib is not installed (the test extra)")

#: Attributes that make a browser fetch (or navigate to) what they name.
URL_ATTRIBUTES = {"href", "src", "xlink:href", "action", "formaction", "srcset", "poster", "data", "background",
                  "manifest", "cite", "ping"}


class Page(HTMLParser):
    """The parsed page: every element with its attributes and ancestors, the text inside each, and the
    contents of <style> and <script>."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.elements, self.stack, self.styles, self.scripts = [], [], [], []
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        element = {"tag": tag, "attrs": dict(attrs), "parents": list(self.stack), "text": []}
        self.elements.append(element)
        if tag not in ("meta", "br", "input", "img", "link", "path", "use", "rect", "circle", "line"):
            self.stack.append(element)

    def handle_startendtag(self, tag, attrs):
        self.elements.append({"tag": tag, "attrs": dict(attrs), "parents": list(self.stack), "text": []})

    def handle_endtag(self, tag):
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i]["tag"] == tag:
                del self.stack[i:]
                break

    def handle_data(self, data):
        for element in self.stack:
            element["text"].append(data)
        if self.stack and self.stack[-1]["tag"] == "style":
            self.styles.append(data)
        if self.stack and self.stack[-1]["tag"] == "script":
            self.scripts.append(data)

    def find(self, tag=None, cls=None, **attrs) -> list[dict]:
        return [e for e in self.elements if (tag is None or e["tag"] == tag)
                and (cls is None or cls in e["attrs"].get("class", "").split())
                and all(e["attrs"].get(k.replace("_", "-")) == v for k, v in attrs.items())]

    @staticmethod
    def text(element) -> str:
        return " ".join(" ".join(element["text"]).split())

    def inside(self, element, tag=None, cls=None) -> list[dict]:
        return [e for e in self.find(tag, cls) if any(p is element for p in e["parents"])]


def external_references(text: str) -> list[str]:
    """Everything in the page a browser would fetch or go to outside the page itself: URL attributes
    that are not `#fragments`, CSS `url(...)` other than `url(#...)`, `@import`, and <link>, <img>, <iframe>,
    <object>, <embed> and external <script src> elements at all."""
    page, found = Page(text), []
    for e in page.elements:
        if e["tag"] in ("link", "img", "iframe", "object", "embed", "base", "audio", "video", "source"):
            found.append(f"<{e['tag']}>")
        for name, value in e["attrs"].items():
            if name in URL_ATTRIBUTES and value is not None and not value.startswith("#"):
                found.append(f"{e['tag']} {name}={value}")
            if name == "style" and value and re.search(r"url\((?!#)", value):
                found.append(f"{e['tag']} style={value}")
    css = "".join(page.styles)
    found += re.findall(r"url\((?!#)[^)]*\)|@import", css)
    found += re.findall(r"(?:fetch|XMLHttpRequest|import\(|WebSocket|EventSource)", "".join(page.scripts))
    return found


@pytest.fixture(scope="module")
def page_text(html_run) -> str:
    run, _ = html_run
    return html.render(sample(run.report))


def test_paracheck_run_writes_a_page_of_its_cases(html_run):
    run, path = html_run
    text = path.read_text()
    page = Page(text)
    rows = page.find("tr", "case")
    assert [r["attrs"]["data-model"] for r in rows] == [c["model"] for c in run.report["cases"]] == ["flux"]
    assert [r["attrs"]["data-status"] for r in rows] == ["detected"]
    [summary] = page.find(id="summary")
    assert "nothing failing" in Page.text(summary) and "1 detected" in Page.text(summary)
    [meta] = page.find(id="meta")
    assert "backend gloo" in Page.text(meta) and "2 ranks" in Page.text(meta)
    assert run.report["cases"][0]["replay"].startswith("paracheck run --layouts tp2 --route native")
    assert "backward-only" in Page.text(rows[0]) and external_references(text) == []


def test_rows_failing_first_with_filters_by_model_layout_and_status(page_text):
    page = Page(page_text)
    rows = page.find("tr", "case")
    assert [r["attrs"]["data-status"] for r in rows] == ["fail", "error", "xfail", "pass", "detected", "skip"]
    options = {name: [o["attrs"]["value"] for o in page.inside(page.find("select", id=f"f-{name}")[0], "option")]
               for name in ("model", "layout", "status")}
    assert options == {"model": ["", "flux2", "wan", "flux"], "layout": ["", "u2", "r2", "tp2"],
                       "status": ["", "failing", "fail", "error", "xfail", "pass", "detected", "skip"]}
    [summary] = page.find(id="summary")
    assert Page.text(summary).startswith("2 failing 6 cases: 1 failed 1 errors 1 xfailed 1 passed 1 detected 1 skipped")
    # the counts filter by status too
    assert [b["attrs"]["data-status"] for b in page.inside(summary, "button", "badge")] == \
        ["fail", "error", "xfail", "pass", "detected", "skip"]
    assert [r["attrs"]["data-failing"] for r in rows] == ["1", "1", "0", "0", "0", "0"]
    for row in rows:  # numbers in the monospace class
        assert all("num" in c["attrs"].get("class", "") for c in page.inside(row, "td")[-3:-1])


@needs_matplotlib
def test_a_failing_case_opens_to_its_localization_plots(page_text):
    page = Page(page_text)
    fail = page.find("tr", "case", data_status="fail")[0]
    assert "expandable" in fail["attrs"]["class"]
    [detail] = page.find("tr", "detail", id=fail["attrs"]["id"] + "-detail")
    assert "hidden" in detail["attrs"]  # closed until clicked
    [forward] = page.inside(detail, "figure", "forward-plot")
    [grads] = page.inside(detail, "figure", "grads-plot")
    fwd_svg, grad_svg = page.inside(forward, "svg")[0], page.inside(grads, "svg")[0]
    labels = [Page.text(t) for t in page.inside(fwd_svg, "text")]
    assert labels[:len(MODULES)] == MODULES  # every module, in execution order
    assert f"first beyond tolerance: {FIRST}" in labels and "atol = rtol = 1e-05" in labels
    bold = [t for t in page.inside(fwd_svg, "text") if "font-weight: 700" in t["attrs"].get("style", "")]
    assert [Page.text(t) for t in bold] == [FIRST]  # the first diverging module's tick is marked
    assert re.search(r"10\^\{-5\}", page_text)  # log-scale ticks (matplotlib's mathtext)
    grad_labels = [Page.text(t) for t in page.inside(grad_svg, "text")]
    names = [p["param"] for p in localization()["grads"]["params"]]
    assert [t for t in grad_labels if t in names] == names  # worst first, as the report lists them
    assert "nan or inf" in grad_labels
    assert "4 of 6 parameters beyond tolerance; every attention weight of block 1 and after" in Page.text(detail)
    assert f"first module beyond tolerance: {FIRST}" in Page.text(detail) and "pos_embed" in Page.text(detail)
    assert "reproduce: paracheck run --models flux2 --layouts u2" in Page.text(detail)
    # the xfail's localization has grads only; the error opens to its traceback; the pass does not open
    xfail_detail = page.find("tr", "detail", id=page.find("tr", "case", data_status="xfail")[0]["attrs"]["id"]
                             + "-detail")[0]
    assert not page.inside(xfail_detail, "figure", "forward-plot") and page.inside(xfail_detail, "figure", "grads-plot")
    assert "RuntimeError: planted" in Page.text(page.find("tr", "detail")[1])
    error = page.find("tr", "case", data_status="error")[0]  # the pass that raised, in its reason and its check
    error_detail = Page.text(page.find("tr", "detail", id=error["attrs"]["id"] + "-detail")[0])
    assert "forward: RuntimeError: planted" in Page.text(error) + error_detail
    assert "forward raised RuntimeError: planted" in error_detail
    assert "expandable" not in page.find("tr", "case", data_status="pass")[0]["attrs"]["class"]


def test_known_failures_grouped_with_their_cases_and_a_reproduction(page_text):
    page = Page(page_text)
    [known] = page.find("section", id="known")
    items = page.inside(known, "li", "known")
    assert len(items) == 1
    text = Page.text(items[0])
    assert Page.text(page.inside(items[0], "p", "known-reason")[0]) == "ring backward rotates the wrong way [lib 1.0]"
    assert "covers 1 case: wan: r2" in text and "reproduce: paracheck run --models wan --layouts r2" in text
    [link] = page.inside(items[0], "a")
    assert page.find("tr", "case", id=link["attrs"]["href"][1:])[0]["attrs"]["data-status"] == "xfail"
    [skips] = page.find("section", id="skips")
    assert "WanTransformer3DModel has no _tp_plan wan: tp2" in Page.text(skips)


def test_skips_of_a_missing_plan_group_by_it_as_the_terminal_does(html_run):
    run, _ = html_run
    data = sample(run.report)
    skip = next(c for c in data["cases"] if c["status"] == "skip")
    plan = {"kind": "skip", "missing_plan": "_tp_plan"}
    more = [dict(skip, model=m, layout=l, reason=f"{m} reworded ({l})", failure=plan)
            for m, l in (("wan", "tp2"), ("ltx", "tp2"), ("wan", "tp2xu2"), ("ltx", "tp2xu2"), ("qwen", "tp2"))]
    data["cases"] += more
    page = Page(html.render(data, with_plots=False))
    [skips] = page.find("section", id="skips")
    assert [Page.text(li) for li in page.inside(skips, "li")] == [
        "wan, ltx: no _tp_plan, so tp2, tp2xu2 cannot run", "qwen: no _tp_plan, so tp2 cannot run",
        "WanTransformer3DModel has no _tp_plan wan: tp2"]


def test_nothing_is_fetched_and_ids_are_unique(page_text):
    assert external_references(page_text) == []
    assert "http:" not in page_text and "https:" not in page_text and page_text.isascii()
    ids = [e["attrs"]["id"] for e in Page(page_text).elements if "id" in e["attrs"]]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("planted", ['<img src="https://example.com/x.png">', '<a href="http://example.com">x</a>',
                                     '<style>body{background:url(//example.com/b.png)}</style>',
                                     '<style>@import "x.css";</style>', '<script src="app.js"></script>',
                                     '<svg><use xlink:href="other.svg#a"/></svg>', "<script>fetch('/x')</script>"])
def test_the_reference_check_finds_a_planted_reference(page_text, planted):
    """Negative control: the check above can fail."""
    assert external_references(page_text.replace("</body>", planted + "</body>")) != []


def test_without_matplotlib_the_page_has_its_tables_and_says_plots_need_it(html_run):
    run, _ = html_run
    page = Page(html.render(sample(run.report), with_plots=False))
    assert not page.find("svg") and page.find(id="no-plots")
    assert "Plots need matplotlib" in Page.text(page.find(id="no-plots")[0])
    assert len(page.find("tr", "case")) == 6 and page.find("table", "params")


def test_text_from_the_report_is_escaped(html_run):
    run, _ = html_run
    data = sample(run.report)
    data["cases"][0]["reason"] = "<script>alert(1)</script> & <b>"
    page = Page(html.render(data, with_plots=False))
    assert len(page.find("script")) == 1  # only the page's own
    assert any("<script>alert(1)</script> & <b>" in Page.text(r) for r in page.find("tr", "case"))


def test_paracheck_report_writes_the_page_of_a_json_report(html_run, tmp_path, capsys):
    run, _ = html_run
    source = tmp_path / "run.json"
    source.write_text(json.dumps(sample(run.report)))
    out = tmp_path / "out.html"
    assert main(["report", str(source), "--html", str(out)]) == 0
    assert f"wrote {out} (6 cases)" in capsys.readouterr().out
    assert out.read_text() == html.render(json.loads(source.read_text()))


@pytest.mark.parametrize("content, message", [
    (None, "cannot read it (No such file or directory)"),
    ("{", "not a JSON report: invalid JSON at line 1 column 2"),
    (b"\xff\xfe{", "not a JSON report: not UTF-8 text"),
    ("[1, 2]", "not a paracheck report: the top level is a JSON list, not an object"),
    ('{"summary": {}}', "not a paracheck report: no 'cases' list at the top level"),
    ('{"cases": [{"id": "x"}]}', "not a paracheck report: case 1 is not an object with a 'status'"),
])
def test_paracheck_report_refuses_what_is_no_report(tmp_path, capsys, content, message):
    source = tmp_path / "run.json"
    if isinstance(content, bytes):
        source.write_bytes(content)
    elif content is not None:
        source.write_text(content)
    assert main(["report", str(source), "--html", str(tmp_path / "out.html")]) == 2
    err = capsys.readouterr().err
    assert f"paracheck: error: report {source}: {message}" in err, err
    assert not (tmp_path / "out.html").exists()


def test_paracheck_report_checks_the_html_path_first(tmp_path, capsys):
    assert main(["report", str(tmp_path / "none.json"), "--html", str(tmp_path / "no" / "out.html")]) == 2
    assert f"--html {tmp_path / 'no' / 'out.html'}: folder {tmp_path / 'no'} does not exist" in capsys.readouterr().err


# -- any report --------------------------------------------------------------------------------------

_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
_figure = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3), _text,
                    st.booleans())
_case = st.fixed_dictionaries({"status": st.sampled_from(html.ORDER + ("weird",))}, optional={
    "id": _text, "model": _text, "layout": _text, "reason": _text, "variant": _text, "control": _text,
    "known_failure": _text, "replay": _text,
    "checks": st.one_of(_figure, st.lists(st.fixed_dictionaries({}, optional={
        "id": st.sampled_from(["parity.forward", "parity.grads"]), "max_abs": _figure, "detail": _figure,
        "failed_ranks": st.one_of(_figure, st.lists(st.one_of(st.integers(0, 7), _figure)))}))),
    "error_ranks": st.one_of(_figure, st.lists(st.integers(0, 7))), "traceback": _figure, "dtype": _figure,
    "localization": st.one_of(_text, st.fixed_dictionaries({}, optional={
        "forward": st.fixed_dictionaries({}, optional={
            "modules": st.lists(st.fixed_dictionaries({}, optional={"name": _text, "max_abs": _figure,
                                                                    "max_rel": _figure, "ok": _figure}), max_size=5),
            "first": _figure, "atol": _figure, "rtol": _figure, "ranks": _figure,
            "not_compared": st.one_of(_figure, st.lists(st.just({"name": 1})))}),
        "grads": st.fixed_dictionaries({}, optional={
            "params": st.lists(st.fixed_dictionaries({}, optional={"name": _text, "max_abs": _figure, "ok": _figure}),
                               max_size=5), "pattern": _figure, "ranks": st.lists(_figure)})}))})


@settings(max_examples=60)
@given(st.lists(_case, max_size=6), st.dictionaries(st.sampled_from(["backend", "nproc", "versions", "events",
                                                                     "worlds", "paracheck"]), _figure))
def test_any_report_renders_one_row_per_case(cases, meta):
    """Whatever a report holds (another version's, a hand-edited one), the page renders: a row per case,
    ids unique, nothing fetched, the reason text as given."""
    text = html.render(dict(meta, cases=cases), with_plots=False)
    page = Page(text)
    rows = page.find("tr", "case")
    assert len(rows) == len(cases) and external_references(text) == []
    ids = [e["attrs"]["id"] for e in page.elements if "id" in e["attrs"]]
    assert len(ids) == len(set(ids))


@needs_matplotlib
@settings(max_examples=12)
@given(st.lists(st.tuples(_figure, _figure, st.sampled_from([True, False, None])), min_size=1, max_size=8),
       _figure, _figure)
def test_plots_draw_any_figures(points, atol, rtol):
    """Zeros, NaN, infinity, missing and non-numeric figures and tolerances all draw (a log scale takes none
    of them as they are)."""
    modules = [{"module": f"m{i}", "param": f"m{i}", "max_abs": a, "max_rel": r, "within": ok}
               for i, (a, r, ok) in enumerate(points)]
    forward = plots.forward_svg(_forward(modules=modules, atol=atol, rtol=rtol, first="m0"), "f")
    grads = plots.grads_svg(_grads(params=modules), atol, rtol, "g")
    for svg in (forward, grads):
        assert svg.startswith('<svg class="plot"') and svg.rstrip().endswith("</svg>")
        assert "http" not in svg


@needs_matplotlib
def test_plots_draw_figures_at_the_ends_of_the_floats():
    """Found by the property above: an axis a decade past 6e306 is infinite, one below 5e-324 zero."""
    modules = [{"module": "a", "param": "a", "max_abs": 5e-324, "within": True},
               {"module": "b", "param": "b", "max_abs": 1.7e308, "within": False}]
    for atol, rtol in ((None, 5.99e306), (5e-324, None)):
        assert plots.forward_svg(_forward(modules=modules, atol=atol, rtol=rtol), "f").rstrip().endswith("</svg>")
        assert plots.grads_svg(_grads(params=modules), atol, rtol, "g").rstrip().endswith("</svg>")


def _forward(**data) -> ForwardLocalization:
    return ForwardLocalization.from_json(data)


def _grads(**data) -> GradsLocalization:
    return GradsLocalization.from_json(data)


def test_numbers_are_read_defensively():
    assert plots.number(True) is None and plots.number("1e-3") is None and plots.number(None) is None
    assert plots.number(2) == 2.0 and math.isnan(plots.number(float("nan")))
    assert localization()["forward"]["first"]["module"] == FIRST


@needs_matplotlib
def test_paracheck_report_imports_no_torch(html_run, tmp_path):
    """The page of a report is drawn without torch (plots included), in a process of its own."""
    import subprocess
    import sys

    from tests.support import ROOT
    from tests.cli.test_torchfree import PROBE

    run, _ = html_run
    source = tmp_path / "run.json"
    source.write_text(json.dumps(sample(run.report)))
    argv = ["report", str(source), "--html", str(tmp_path / "out.html")]
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.stdout.split()[-2:] == ["NO-TORCH", "0"], out.stdout + out.stderr
    assert "<svg" in (tmp_path / "out.html").read_text()


def test_a_localization_that_is_not_the_schemas_reads_as_absent():
    """A report from elsewhere: a part that is no object is left out, never raised on; a module named by its key
    alone (`first` as a string) reads as that module."""
    assert not Localization.from_json("garbage") and not Localization.from_json({"forward": 3})
    found = Localization.from_json({"forward": {"modules": [3, {"module": "a"}], "first": "a", "ranks": "x"}})
    assert [m.module for m in found.forward.modules] == ["a"] and found.forward.first.module == "a"
    assert found.forward.merged.ranks == ()


@needs_matplotlib
def test_the_no_grad_forward_gets_its_own_plot(html_run):
    run, _ = html_run
    data = sample(run.report)
    fail = next(c for c in data["cases"] if c["status"] == "fail")
    loc = localization()
    fail["localization"] = dict(loc, inference=dict(loc["forward"], origin=loc["forward"]["first"]["module"]))
    page = Page(html.render(data))
    detail = page.find("tr", "detail", id=page.find("tr", "case", data_status="fail")[0]["attrs"]["id"] + "-detail")[0]
    assert len(page.inside(detail, "figure", "forward-plot")) == 2 and page.inside(detail, "figure", "grads-plot")
    assert [Page.text(h) for h in page.inside(detail, "h3")] == [
        "Forward, module by module (on ranks 0-1)", "No-grad forward, module by module (on ranks 0-1)",
        "Gradients, parameter by parameter (on rank 1)"]
    ids = [e["attrs"]["id"] for e in page.elements if "id" in e["attrs"]]
    assert len(ids) == len(set(ids))


def test_a_filter_option_matches_its_rows_whatever_the_value():
    """Each filter option's value is the text its rows carry, for any model or layout (None included)."""
    cases = [{"status": "pass", "model": m, "layout": l} for m, l in (("a b", "tp2"), (None, "u2"), ('x"<', 3))]
    page = Page(html.render({"cases": cases}, with_plots=False))
    for key in ("model", "layout"):
        values = [o["attrs"]["value"] for o in page.inside(page.find("select", id=f"f-{key}")[0], "option")][1:]
        assert values == [r["attrs"][f"data-{key}"] for r in page.find("tr", "case")]


def test_a_url_in_a_known_failure_is_text_not_a_reference(html_run):
    run, _ = html_run
    data = sample(run.report)
    url = "https://github.com/example/project/issues/1"
    next(c for c in data["cases"] if c["status"] == "xfail")["known_failure"] = f"a bug [{url}]"
    text = html.render(data, with_plots=False)
    assert url in text and external_references(text) == [] and not Page(text).find("a", href=url)


def test_a_hang_its_case_declares_is_shown_as_declared_and_an_undeclared_one_as_the_run_breaking():
    """The events section (`html._events`): a hang whose case is an xfail on the hang itself is a declared hang (the
    exit code 0 `report.declared_hang` gives it); another event, or a hang of a failing case, breaks the run."""
    hang = {"kind": "hang", "index": 0, "message": "case 0 hung past --timeout 6s", "case": "m-u4-auto"}
    case = {"id": "m-u4-auto", "status": "xfail", "failure": {"kind": "hang"}}
    declared = html._events({"events": [hang], "cases": [case]})
    assert "<h2>Declared hangs</h2>" in declared and "a declared hang (xfail)" in declared
    broke = html._events({"events": [hang], "cases": [dict(case, status="error")]})
    assert "<h2>The run broke</h2>" in broke and "run broke (hang)" in broke
    mixed = html._events({"events": [hang, dict(hang, kind="signal", case="")], "cases": [case]})
    assert "<h2>The run broke</h2>" in mixed and "a declared hang (xfail)" in mixed
