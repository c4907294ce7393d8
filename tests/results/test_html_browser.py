"""The HTML report in a real browser: headless Chromium (Debian's `chromium`) driven by Playwright with that
executable. The page loads with no console error and no network request, the filters change the rows
shown, a failing case opens to its plots, and a screenshot is kept (under $PARACHECK_ARTIFACTS, else the
test's tmp_path).

Skips when Chromium or Playwright is absent, unless PARACHECK_REQUIRE_BROWSER=1 (CI sets it in .ci/run),
which makes their absence a failure. Playwright's own browser downloads are never used."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from paracheck.cli.main import main
from paracheck.results import plots
from tests.html_sample import FIRST, sample

CHROMIUM = os.environ.get("PARACHECK_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"


def _require(what: str) -> None:
    if os.environ.get("PARACHECK_REQUIRE_BROWSER") == "1":
        pytest.fail(f"PARACHECK_REQUIRE_BROWSER=1 but {what}")
    pytest.skip(what)


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _require("playwright is not installed (pip install playwright; never `playwright install`)")
    if not os.access(CHROMIUM, os.X_OK):
        _require(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    if not plots.available():
        _require("matplotlib is not installed (the test extra), so the page has no plots to open")
    with sync_playwright() as p:
        # --no-sandbox: CI and this machine run tests as root, where Chromium's sandbox refuses to start.
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def page_file(html_run, tmp_path_factory) -> Path:
    """The sample report's page, written by `paracheck report` from its JSON."""
    run, _ = html_run
    folder = tmp_path_factory.mktemp("browser")
    source, out = folder / "run.json", folder / "report.html"
    source.write_text(json.dumps(sample(run.report)))
    assert main(["report", str(source), "--html", str(out)]) == 0
    return out


def _artifacts(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("PARACHECK_ARTIFACTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _visible_rows(page) -> list[str]:
    return page.eval_on_selector_all("tr.case", "rows => rows.filter(r => !r.hidden && r.offsetParent !== null)"
                                     ".map(r => r.dataset.model + ' ' + r.dataset.layout + ' ' + r.dataset.status)")


def test_the_page_in_chromium(browser, page_file, tmp_path):
    page = browser.new_page(viewport={"width": 1360, "height": 900})
    console, errors, requests, refused = [], [], [], []
    page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: requests.append(r.url))

    def route(r):
        if r.request.url.startswith(("file:", "data:")):
            r.continue_()
        else:
            refused.append(r.request.url)
            r.abort()

    page.route("**/*", route)
    page.goto(page_file.as_uri())
    page.wait_for_load_state("load")
    assert errors == [] and [m for m in console if m.startswith("error")] == [], (errors, console)
    assert refused == [] and all(u.startswith(("file:", "data:")) for u in requests), requests
    assert requests == [page_file.as_uri()]  # the page itself, nothing else

    everything = _visible_rows(page)
    assert everything == ["flux2 u2 fail", "wan u2 error", "wan r2 xfail", "flux u2 pass", "flux tp2 detected",
                          "wan tp2 skip"]
    page.select_option("#f-model", "wan")
    assert _visible_rows(page) == ["wan u2 error", "wan r2 xfail", "wan tp2 skip"]
    assert page.text_content("#shown") == "3 of 6 cases shown"
    page.select_option("#f-layout", "u2")
    assert _visible_rows(page) == ["wan u2 error"]
    page.select_option("#f-model", "")
    page.select_option("#f-layout", "")
    page.select_option("#f-status", "failing")
    assert _visible_rows(page) == ["flux2 u2 fail", "wan u2 error"]
    page.click("button.badge[data-status=xfail]")  # a count in the summary filters by its status
    assert _visible_rows(page) == ["wan r2 xfail"]
    page.click("button.badge[data-status=xfail]")
    assert _visible_rows(page) == everything

    detail = page.locator("tr.detail").first
    assert not detail.is_visible() and page.locator("svg.plot").first.is_visible() is False
    page.click("tr.case[data-status=fail]")
    assert detail.is_visible()
    for figure in ("figure.forward-plot svg", "figure.grads-plot svg"):
        box = detail.locator(figure).bounding_box()
        assert box and box["width"] > 300 and box["height"] > 150, (figure, box)
    assert FIRST in detail.locator("figure.forward-plot").inner_text()
    assert page.get_attribute("tr.case[data-status=fail] button.toggle", "aria-expanded") == "true"
    # filtering the open case away hides its details, and bringing it back shows them again
    page.select_option("#f-model", "wan")
    assert not detail.is_visible()
    page.select_option("#f-model", "")
    assert detail.is_visible()

    shot = _artifacts(tmp_path) / "html-report.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    assert [m for m in console if m.startswith("error")] == [] and errors == [] and refused == []
    page.close()


def test_a_link_to_a_case_opens_it(browser, page_file):
    """The known-failures section links each case: following one opens its row, whatever the filters."""
    from playwright.sync_api import expect

    page = browser.new_page()
    page.goto(page_file.as_uri())
    page.select_option("#f-model", "flux2")
    page.click("#known details summary")
    page.click("#known a")
    # The row opens on `hashchange`, which the browser fires after the click returns: wait for it (Playwright's
    # `expect` retries until it holds, 5 s at most), or a loaded machine reads the row before it opens.
    row = page.locator("tr.case[data-status=xfail]")
    expect(row).to_be_visible()
    expect(row).to_have_class(re.compile(r"\bopen\b"))
    expect(page.locator("tr.detail", has=page.locator("figure.grads-plot")).nth(1)).to_be_visible()
    page.close()


def test_a_pipeline_run_at_a_glance_and_its_pictures(browser, pipeline_run, tmp_path):
    """The run at a glance leads the page, a cell opens its case, and a pipeline case's three pictures load (inline,
    nothing fetched) beside its step curve."""
    _, page_file = pipeline_run
    page = browser.new_page(viewport={"width": 1360, "height": 900})
    requests, errors = [], []
    page.on("request", lambda r: requests.append(r.url))
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(page_file.as_uri())
    page.wait_for_load_state("load")
    grid = page.locator("#grid")
    assert grid.is_visible() and grid.bounding_box()["y"] < page.locator("#case-table").bounding_box()["y"]
    assert page.eval_on_selector_all("#grid td.cell", "cells => cells.map(c => c.dataset.layout + ' ' + "
                                     "c.textContent.trim())") == ["u2 pass +5", "tp2 pass +5"]
    page.click("#grid td.cell[data-layout=u2] a")
    opened = page.locator("tr.case.open")
    assert opened.count() == 1 and opened.get_attribute("data-layout") == "u2"
    detail = page.locator("tr.detail:not([hidden])")
    pictures = detail.locator(".pictures img")
    assert pictures.count() == 3
    assert page.evaluate("Array.from(document.querySelectorAll('tr.detail:not([hidden]) .pictures img'))"
                         ".every(i => i.complete && i.naturalWidth > 0)")
    assert detail.locator("svg.curve circle").count() == 3 and detail.locator("svg.curve").is_visible()
    assert errors == [] and all(u.startswith("data:") for u in requests[1:]) and requests[0] == page_file.as_uri()
    shot = _artifacts(tmp_path) / "html-pipeline.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    page.close()
