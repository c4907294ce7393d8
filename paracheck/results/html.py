"""The HTML report: a JSON report (`report.to_json`) as one self-contained page that opens offline.

Everything is inline (CSS, a small script, SVG plots); the page references no URL and fetches nothing.
It shows a summary line of counts by status, the run's metadata, the models-by-layouts picture of the run
(`overview`), the case table (failing cases first) with filters by model, layout and status, each failing case's
details and localization (`plots`), a loop's pictures and error curve where its case carries them (`loopview`),
the known failures with the cases they cover and a command that reproduces them, and the skips grouped by reason.

`render` reads each case into its `Verdict` (`Verdict.from_json`, which reads a field that is missing or not the
schema's as absent, so the report may be another version's) and draws from the records;
`check_report` says what makes a JSON document no report at all. Torch-free; matplotlib only in `plots`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from html import escape

from paracheck.domain.localization import ForwardLocalization, GradsLocalization, Merged, items, number, text
from paracheck.domain.records import CheckId, MergedCheck, RunEvent
from paracheck.launch.attribution import ranks_text
from paracheck.results import localization, loopview, overview, plots
from paracheck.results.grouping import COUNTED, Row, counts, groups
from paracheck.results.runmeta import RunMeta
from paracheck.results.verdict import Verdict

#: Status order in the summary and the table: what needs a look first.
ORDER = ("fail", "error", "missed", "xpass", "xfail", "inconclusive", "pass", "detected", "skip")
FAILING = ("fail", "error", "missed")
#: Statuses whose row opens to the case's details (any case with a localization opens too).
OPENS = ("fail", "error", "missed", "xfail", "xpass", "inconclusive")
NO_PLOTS = "Plots need matplotlib (pip install 'paracheck[html]'); the figures are in the tables."


class ReportError(ValueError):
    """A JSON document that is not a paracheck report."""


@dataclass(frozen=True)
class Shown:
    """A report's case as the page draws it: its verdict (`Verdict.from_json`), its row (`grouping.Row`: its place on
    the page, its id and status as the report wrote them, so another version's status shows as written), the
    command the report gives to replay it, and its place in the run (`at`, the report's order)."""
    verdict: Verdict
    row: Row
    replay: str | None
    at: int


def read(data: dict) -> list[Shown]:
    """The cases of report `data` (checked by `check_report`) in the page's order: failing first, then by `ORDER`,
    run order within a status."""
    rank = {s: i for i, s in enumerate(ORDER)}
    at = sorted(range(len(data["cases"])), key=lambda j: rank.get(data["cases"][j]["status"], len(ORDER)))
    return [_shown(i, data["cases"][j], j) for i, j in enumerate(at)]


def _shown(index: int, case: dict, at: int) -> Shown:
    v = Verdict.from_json(case)
    row = replace(Row.of_verdict(index, v), id=text(case.get("id")) or "", status=case["status"])
    return Shown(v, row, text(case.get("replay")), at)


def check_report(data) -> None:
    """Raise `ReportError` naming what is missing where `data` is not a report `render` can show."""
    if not isinstance(data, dict):
        raise ReportError(f"not a paracheck report: the top level is a JSON {type(data).__name__}, not an object")
    cases = data.get("cases")
    if not isinstance(cases, list):
        raise ReportError("not a paracheck report: no 'cases' list at the top level")
    for i, case in enumerate(cases):
        if not isinstance(case, dict) or not isinstance(case.get("status"), str):
            raise ReportError(f"not a paracheck report: case {i + 1} is not an object with a 'status'")


def render(data: dict, title: str = "paracheck report", with_plots: bool | None = None) -> str:
    """The page for report `data` (checked by `check_report`), in ASCII (anything else as character
    references), so no locale can garble it. `with_plots`: draw the localization plots (default: where
    matplotlib can be imported; without it the page says the plots need it)."""
    check_report(data)
    cases = read(data)
    with_plots = plots.available() if with_plots is None else with_plots
    rows, run_order = [s.row for s in cases], [s.row for s in sorted(cases, key=lambda s: s.at)]
    found = groups(rows)
    body = [_header(data, cases, title), overview.grid(rows, _anchor, run_order), _events(data),
            _cases(cases, with_plots), _known(cases, found), _skips(cases, found),
            f'<footer>paracheck {_e(RunMeta.from_json(data).paracheck or "")} · one self-contained file: nothing here is fetched'
            "</footer>"]
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n<title>{_e(title)}</title>\n'
            f"<style>{CSS}{overview.CSS}{loopview.CSS}</style>\n</head>\n<body>\n" + "\n".join(b for b in body if b)
            + f"\n<script>{SCRIPT}</script>\n</body>\n</html>\n").encode("ascii", "xmlcharrefreplace").decode()


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _e(value) -> str:
    return escape("" if value is None else str(value), quote=True)


def _counts(cases: list[Shown]) -> dict[str, int]:
    """The counts (`grouping.counts`), in the page's order: what needs a look first, then any status it does not know."""
    counted = counts(c.row.status for c in cases)
    return dict({s: counted[s] for s in ORDER}, **{s: n for s, n in counted.items() if s not in ORDER})


def _header(data: dict, cases: list[Shown], title: str) -> str:
    counts = _counts(cases)
    badges = " ".join(f'<button type="button" class="badge s-{_e(s)}" data-status="{_e(s)}">'
                      f'<span class="num">{n}</span> {_e(COUNTED.get(s, s))}</button>'
                      for s, n in counts.items() if n)
    failing = sum(counts.get(s, 0) for s in FAILING)
    verdict = (f'<span class="verdict bad">{failing} failing</span>' if failing else
               '<span class="verdict good">nothing failing</span>')
    code = data.get("exit_code")
    return (f"<header><h1>{_e(title)}</h1>\n<p class=\"summary\" id=\"summary\">{verdict} "
            f"<span class=\"num\">{len(cases)}</span> cases: {badges}"
            + (f' · exit code <span class="num">{_e(code)}</span>' if code is not None else "")
            + f"</p>\n<p class=\"meta\" id=\"meta\">{_meta(data)}</p></header>")


def _meta(data: dict) -> str:
    meta = RunMeta.from_json(data)
    parts = [f"paracheck {_e(meta.paracheck)}"] if meta.paracheck else []
    parts += [f"backend {_e(meta.backend)}"] if meta.backend else []
    parts += [f'<span class="num">{_e(meta.nproc)}</span> ranks'] if meta.nproc is not None else []
    parts += [f"{_e(k)} <span class=\"num\">{_e(v)}</span>" for k, v in meta.versions.items() if v]
    worlds = [_n(meta.worlds, "world")] if meta.worlds is not None else []
    worlds += [f"ranks by {_e(meta.start_method)}"] if meta.start_method else []
    worlds += [_n(meta.references, "reference")] if meta.references is not None else []
    if worlds:
        parts.append(", ".join(worlds))
    return " · ".join(parts)


def _declared(event, data: dict) -> bool:
    """A hang its case's verdict declares (`RunEvent.declared_by`), read from the JSON's cases."""
    case = next((c for c in items(data.get("cases")) if isinstance(c, dict) and c.get("id") == event.case), None)
    failure = case.get("failure") if case else None
    return case is not None and event.declared_by(case.get("status"), failure.get("kind") if isinstance(failure, dict)
                                                  else None)


def _events(data: dict) -> str:
    events = [RunEvent.from_json(e) for e in items(data.get("events"))]
    if not events:
        return ""
    lines = "".join(f"<li><b>{'a declared hang (xfail)' if _declared(e, data) else f'run broke ({_e(e.kind)})'}"
                    f"</b>: {_e(e.message)}</li>" for e in events)
    title = "Declared hangs" if all(_declared(e, data) for e in events) else "The run broke"
    return f'<section class="events" id="events"><h2>{title}</h2><ul>{lines}</ul></section>'


# -- the case table -----------------------------------------------------------------------------------


def _forward(v: Verdict) -> MergedCheck | None:
    """The check whose max_abs the table shows: the forward's, or a pipeline's (which has none)."""
    return v.check(CheckId.FORWARD) or v.check(CheckId.PIPELINE)


def _columns(cases: list[Shown]) -> list[tuple[str, object]]:
    """(heading, cell function); control and dtype only where some case has one."""
    cols = [("model", lambda c: c.row.model), ("layout", lambda c: c.row.layout),
            ("route", lambda c: c.row.route), ("variant", lambda c: c.row.variant)]
    if any(c.row.dtype != "fp32" for c in cases):
        cols.append(("dtype", lambda c: c.row.dtype))
    if any(c.row.control for c in cases):
        cols.append(("control", lambda c: c.row.control or ""))
    return cols


def _cases(cases: list[Shown], with_plots: bool) -> str:
    cols = _columns(cases)
    models = list(dict.fromkeys(c.row.model for c in cases))
    layouts = list(dict.fromkeys(c.row.layout for c in cases))
    statuses = [s for s in ORDER if any(c.row.status == s for c in cases)]
    statuses += [s for s in dict.fromkeys(c.row.status for c in cases) if s not in statuses]
    filters = (_select("model", models, []) + _select("layout", layouts, [])
               + _select("status", statuses, [("failing", "failing (fail, error, missed)")])
               + f'<span id="shown" class="shown">{len(cases)} of {len(cases)} cases shown</span>')
    head = "".join(f"<th>{_e(h)}</th>" for h, _ in cols) + \
        "<th>status</th><th>failed ranks</th><th>max_abs</th><th>reason</th>"
    rows = []
    for case in cases:
        rows.append(_row(case, cols))
        if _opens(case):
            rows.append(f'<tr class="detail" id="{_anchor(case.row)}-detail" hidden><td colspan="{len(cols) + 4}">'
                        f"{_detail(case, with_plots)}</td></tr>")
    note = "" if with_plots else f'<p class="note" id="no-plots">{_e(NO_PLOTS)}</p>'
    return (f'<section id="cases"><h2>Cases</h2>{note}<form class="filters" id="filters">{filters}</form>\n'
            f'<table class="cases" id="case-table"><thead><tr>{head}</tr></thead>\n<tbody>\n'
            + "\n".join(rows) + "\n</tbody></table></section>")


def _select(name: str, values: list[str], extra: list[tuple[str, str]]) -> str:
    options = [("", f"every {name}")] + extra + [(v, v) for v in values]
    inner = "".join(f'<option value="{_e(v)}">{_e(text)}</option>' for v, text in options)
    return f'<label>{_e(name)} <select id="f-{name}" name="{name}">{inner}</select></label> '


def _opens(case: Shown) -> bool:
    v = case.verdict
    return case.row.status in OPENS or bool(v.localization) or loopview.has_view(v.lifted)


def _anchor(row: Row) -> str:
    return "case-" + re.sub(r"[^A-Za-z0-9_-]", "_", str(row.id or row.index)) + f"-{row.index}"


def _row(case: Shown, cols) -> str:
    v, status, anchor = case.verdict, case.row.status, _anchor(case.row)
    forward = _forward(v)
    ranks = v.failed_ranks
    opens = _opens(case)
    toggle = (f'<button type="button" class="toggle" aria-expanded="false" aria-controls="{anchor}-detail"'
              f' title="details">▸</button> ' if opens else "")
    cells = [f"<td>{toggle if j == 0 else ''}{_e(get(case))}</td>" for j, (_, get) in enumerate(cols)]
    cells += [f'<td><span class="status s-{_e(status)}">{_e(status)}</span></td>',
              f'<td class="num">{_e(ranks_text(ranks) if ranks else "")}</td>',
              f'<td class="num">{_number(forward.max_abs if forward else None)}</td>',
              f'<td class="reason" title="{_e(v.reason)}">'
              f'<div class="clamp">{_e(v.reason)}</div></td>']
    data = (f'data-model="{_e(case.row.model)}" data-layout="{_e(case.row.layout)}" '
            f'data-status="{_e(status)}" data-failing="{int(status in FAILING)}"')
    return (f'<tr class="case row-{_e(status)}{" expandable" if opens else ""}" id="{anchor}" {data}>'
            + "".join(cells) + "</tr>")


def _number(value) -> str:
    v = number(value)
    return "" if v is None else _e(f"{v:.1e}")


# -- one case's details -------------------------------------------------------------------------------


def _detail(case: Shown, with_plots: bool) -> str:
    v, anchor = case.verdict, _anchor(case.row)
    parts = [f'<p class="why"><b>{_e(case.row.id)}</b>: {_e(v.reason)}</p>']
    if v.known:
        parts.append(f'<p>known failure: {_e(v.known)}</p>')
    if case.replay:
        parts.append(f'<p>reproduce: <code class="replay">{_e(case.replay)}</code></p>')
    parts.append(_checks(v.checks))
    parts.append(loopview.section(v.lifted, anchor))
    if v.localization:
        parts.append(_localization(v, anchor, with_plots))
    if v.traceback:
        parts.append(f"<details><summary>traceback</summary><pre>{_e(v.traceback)}</pre></details>")
    return "\n".join(parts)


def _checks(checks: list[MergedCheck]) -> str:
    if not checks:
        return ""
    rows = "".join(
        f'<tr><td>{_e(c.id.value)}</td><td><span class="status s-{_e(c.status.value)}">{_e(c.status.value)}'
        f'</span></td><td class="num">{_e(ranks_text(c.failed_ranks))}</td>'
        f'<td class="num">{_number(c.max_abs)}</td><td class="num">{_number(c.max_rel)}</td>'
        f'<td class="num">{_number(c.atol)}</td><td class="num">{_number(c.rtol)}</td>'
        f'<td class="reason">{_e(c.detail)}</td></tr>' for c in checks)
    return ('<table class="checks"><thead><tr><th>check</th><th>status</th><th>failed ranks</th><th>max_abs</th>'
            f"<th>max_rel</th><th>atol</th><th>rtol</th><th>detail</th></tr></thead><tbody>{rows}</tbody></table>")


def _localization(v: Verdict, anchor: str, with_plots: bool) -> str:
    found = v.localization
    parts = ['<div class="localization">']
    for part, title, forward in found.forward_parts():
        if forward.decode_step is not None:
            title += f" ({forward.mode}, decode step {forward.decode_step:.0f})"
        parts.append(_forward_part(forward, title, f"{anchor}-{part}", with_plots))
    if found.grads is not None:
        parts.append(_grads_part(found.grads, v.check(CheckId.GRADS), anchor, with_plots))
    if found.steps is not None and not found.steps.error:
        parts.append(_steps_part(found.steps, v.check(CheckId.STEPS), anchor, with_plots))
    if found.not_run:
        parts.append(f'<p class="not-run">{_e(found.not_run)}</p>')
    return "\n".join(parts) + "</div>"


def _steps_part(steps, check: MergedCheck | None, anchor: str, with_plots: bool) -> str:
    """A failing parity.steps' first parting step, rerun: where it parts, then that step's forward (where it is
    the forward) and gradients (where they part), drawn as the case's own are."""
    count = {k: "?" if v is None else str(int(v)) for k, v in (("step", steps.step), ("of", steps.of))}
    step = f"step {count['step']} of {count['of']}"
    try:
        words = localization.steps_line(steps)
    except (AttributeError, TypeError):  # a report from elsewhere, short of what the line names
        words = None
    parts = [f'<h3>Training, {_e(step)}, rerun from where it began{_e(_from_ranks(steps.merged))}</h3>'
             f'<p class="where steps">{_e(words or "")}</p>']
    if steps.where == "forward" and steps.forward:
        parts.append(_forward_part(steps.forward, f"Step {count['step']} forward",
                                   f"{anchor}-steps-forward", with_plots))
    if steps.grads:
        parts.append(_grads_part(steps.grads, check, f"{anchor}-steps", with_plots))
    return "\n".join(parts)


def _from_ranks(merged: Merged) -> str:
    ranks = list(merged.ranks)
    return f" (on {'rank' if len(ranks) == 1 else 'ranks'} {ranks_text(ranks)})" if ranks else ""


def _forward_part(forward: ForwardLocalization, title: str, prefix: str, with_plots: bool) -> str:
    modules = forward.modules or ()
    first = forward.first.module if forward.first else None
    last = forward.last_agreeing.module if forward.last_agreeing else None
    origin = forward.origin
    where = (f'first module beyond tolerance: <code class="first">{_e(first)}</code>' if first else
             "no module beyond tolerance")
    if origin and origin != first:
        where += f', arising in <code class="origin">{_e(origin)}</code> (its inputs agree)'
    if last:
        where += f'; last agreeing: <code>{_e(last)}</code>'
    head = (f'<h3>{_e(title)}, module by module{_e(_from_ranks(forward.merged))}</h3><p class="where">{where} '
            f'(atol <span class="num">{_number(forward.atol)}</span>, rtol <span class="num">'
            f'{_number(forward.rtol)}</span>, {_n(len(modules), "module")} compared)</p>')
    plot = _plot(lambda: plots.forward_svg(forward, prefix, title.lower()), "forward-plot", with_plots, modules)
    skipped = forward.not_compared or ()
    rest = ""
    if skipped:
        lines = "".join(f"<li><code>{_e(m.module)}</code>: {_e(m.why)}</li>" for m in skipped)
        rest = f"<details><summary>{_n(len(skipped), 'module')} not compared</summary><ul>{lines}</ul></details>"
    return head + plot + rest


def _grads_part(grads: GradsLocalization, check: MergedCheck | None, anchor: str, with_plots: bool) -> str:
    params = grads.params or ()
    beyond = sum(p.within is False for p in params)
    head = (f'<h3>Gradients, parameter by parameter{_e(_from_ranks(grads.merged))}</h3>'
            f'<p class="where"><span class="num">{beyond}</span> of <span class="num">{len(params)}</span> '
            f"parameters beyond tolerance" + (f"; {_e(grads.pattern)}" if grads.pattern else "") + "</p>")
    tolerances = (check.atol, check.rtol) if check else (None, None)
    plot = _plot(lambda: plots.grads_svg(grads, *tolerances, f"{anchor}-grads"),
                 "grads-plot", with_plots, params)
    state = {True: "ok", False: "beyond", None: ""}
    rows = "".join(f'<tr><td><code>{_e(p.param)}</code></td><td class="num">{_number(p.max_abs)}</td>'
                   f'<td class="num">{_number(p.max_rel)}</td><td>{state[p.within]}</td>'
                   f'<td>{_e(p.why or None)}</td></tr>' for p in params)
    table = (f"<details><summary>every parameter ({len(params)})</summary><table class=\"params\"><thead><tr>"
             "<th>parameter</th><th>max_abs</th><th>max_rel</th><th></th><th></th></tr></thead>"
             f"<tbody>{rows}</tbody></table></details>") if params else ""
    return head + plot + table


def _plot(draw, kind: str, with_plots: bool, items: list) -> str:
    if not items:
        return ""
    if not with_plots:
        return f'<p class="note">{_e(NO_PLOTS)}</p>'
    return f'<figure class="{kind}">{draw()}</figure>'


# -- known failures and skips -------------------------------------------------------------------------


def _known(cases: list[Shown], found) -> str:
    """The known failures (`grouping.groups`): each entry's reason, the cases it covers, a replay, the links."""
    known = [g for g in found if g.kind in ("xfail", "xpass")]
    if not known:
        return ""
    entries = []
    for g in known:
        links = ", ".join(f'<a href="#{_anchor(r)}">{_e(r.id)}</a>' for r in g.rows)
        replay = next((cases[r.index].replay for r in g.rows if cases[r.index].replay), None)
        xpass = g.kind == "xpass"
        entries.append(
            f'<li class="known{" xpass" if xpass else ""}"><p class="known-reason">'
            + ("<b>declared but passed, remove the entry:</b> " if xpass else "")
            + f'{_e(g.title)}</p><p>covers <span class="num">{len(g.rows)}</span> '
            f'{"case" if len(g.rows) == 1 else "cases"}: {_e(g.covers)}</p>'
            + (f'<p>reproduce: <code class="replay">{_e(replay)}</code></p>' if replay else "")
            + f'<details><summary>the cases</summary><p class="links">{links}</p></details></li>')
    return f'<section id="known"><h2>Known failures</h2><ul class="known-list">{"".join(entries)}</ul></section>'


def _skips(cases: list[Shown], found) -> str:
    """The skips, grouped as the terminal groups them (`grouping.groups`)."""
    skipped = sum(c.row.status == "skip" for c in cases)
    if not skipped:
        return ""
    lines = [f"<li>{_e(g.never_line)}</li>" for g in found if g.kind == "never"]
    lines += [f'<li>{_e(g.title)}<br><span class="covers">{_e(g.covers)}</span></li>'
              for g in found if g.kind == "skip"]
    lines += [f'<li>{_e(g.title)}<br><span class="covers">'
              + _e("; ".join(f"{c} on {', '.join(ms)}" for c, ms in g.controls)) + "</span></li>"
              for g in found if g.kind == "skip-controls"]
    return (f'<section id="skips"><details><summary><h2>Skipped: {_n(skipped, "case")}</h2></summary>'
            f'<ul>{"".join(lines)}</ul></details></section>')


CSS = """
:root{--bad:#c62828;--good:#2e7d32;--warn:#ef6c00;--known:#6a1b9a;--muted:#616161;--line:#e0e0e0}
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;margin:1.2em 2em;color:#212121}
h1{font-size:1.4em;margin:0 0 .2em}h2{font-size:1.15em;margin:1.4em 0 .4em}h3{font-size:1em;margin:1em 0 .2em}
.num,code,pre,td.num{font-family:ui-monospace,"DejaVu Sans Mono",Menlo,Consolas,monospace;
 font-variant-numeric:tabular-nums}
code{font-size:.92em;background:#f5f5f5;padding:0 .25em;border-radius:3px}
pre{background:#f5f5f5;padding:.6em;overflow:auto}
.summary{font-size:1.05em;margin:.3em 0}.meta{color:var(--muted);margin:.2em 0}
.verdict{font-weight:700;margin-right:.6em}.verdict.bad{color:var(--bad)}.verdict.good{color:var(--good)}
.badge{border:1px solid var(--line);border-radius:1em;padding:.05em .6em;margin:0 .15em;background:#fafafa;
 cursor:pointer;font:inherit}
.badge:hover{background:#eee}
.s-fail,.s-error,.s-missed{color:var(--bad)}.s-xpass{color:var(--warn)}.s-xfail{color:var(--known)}
.s-pass,.s-detected{color:var(--good)}.s-skip,.s-inconclusive{color:var(--muted)}
.status{font-weight:600}tr.row-fail .status,tr.row-error .status,tr.row-missed .status{text-transform:uppercase}
.filters{margin:.4em 0 .6em;display:flex;gap:1.2em;align-items:center;flex-wrap:wrap}.shown{color:var(--muted)}
table{border-collapse:collapse}
th,td{padding:.2em .6em;border-bottom:1px solid var(--line);text-align:left;vertical-align:top}
th{background:#fafafa;position:sticky;top:0}td.num{text-align:right;white-space:nowrap}
td.reason{max-width:52em;overflow-wrap:anywhere;color:#424242}
table.cases>thead th,table.cases>tbody>tr.case>td:not(.reason){white-space:nowrap}
.clamp{display:-webkit-box;-webkit-line-clamp:2;-webkit-box-orient:vertical;overflow:hidden}
tr.row-fail,tr.row-error,tr.row-missed{background:#fff5f5}
tr.expandable{cursor:pointer}tr.expandable:hover{background:#f3f6fb}
.toggle{border:0;background:none;cursor:pointer;font-size:1em;padding:0 .2em;width:1.2em}
tr.open .toggle{transform:rotate(90deg)}
tr.detail>td{background:#fcfcfc;padding:.6em 1.2em 1em;border-left:3px solid #90a4ae}
table.checks,table.params{font-size:.92em;margin:.4em 0}
figure{margin:.4em 0;overflow-x:auto}svg.plot{max-width:100%;height:auto}
.note{color:var(--warn)}.events{border:2px solid var(--bad);padding:.2em 1em;border-radius:4px}
.known-list>li{margin:.6em 0}.known-reason{font-weight:600;margin:.1em 0}.known-list p{margin:.15em 0}
li.xpass .known-reason{color:var(--warn)}.covers{color:var(--muted)}
#skips summary h2{display:inline}footer{margin-top:2em;color:var(--muted);font-size:.9em}
"""

SCRIPT = """
(function () {
  "use strict";
  var rows = Array.prototype.slice.call(document.querySelectorAll("tr.case"));
  var keys = ["model", "layout", "status"];
  var shown = document.getElementById("shown");
  function filter(key) { return document.getElementById("f-" + key); }
  function matches(row) {
    return keys.every(function (key) {
      var want = filter(key).value;
      if (!want) return true;
      if (key === "status" && want === "failing") return row.dataset.failing === "1";
      return row.dataset[key] === want;
    });
  }
  function detailOf(row) {
    var next = row.nextElementSibling;
    return next && next.classList.contains("detail") ? next : null;
  }
  function apply() {
    var n = 0;
    rows.forEach(function (row) {
      var show = matches(row);
      row.hidden = !show;
      var detail = detailOf(row);
      if (detail) detail.hidden = !show || !row.classList.contains("open");
      if (show) n += 1;
    });
    shown.textContent = n + " of " + rows.length + " cases shown";
  }
  function toggle(row, open) {
    var detail = detailOf(row);
    if (!detail) return;
    row.classList.toggle("open", open);
    var button = row.querySelector("button.toggle");
    if (button) button.setAttribute("aria-expanded", String(row.classList.contains("open")));
    apply();
  }
  keys.forEach(function (key) { filter(key).addEventListener("change", apply); });
  rows.forEach(function (row) {
    if (row.classList.contains("expandable")) {
      row.addEventListener("click", function () { toggle(row); });
    }
  });
  Array.prototype.forEach.call(document.querySelectorAll("button.badge"), function (badge) {
    badge.addEventListener("click", function () {
      var select = filter("status");
      select.value = select.value === badge.dataset.status ? "" : badge.dataset.status;
      apply();
    });
  });
  function openHash() {
    var row = location.hash && document.getElementById(location.hash.slice(1));
    if (row && row.classList.contains("case")) {
      keys.forEach(function (key) { filter(key).value = ""; });
      toggle(row, true);
      row.scrollIntoView();
    }
  }
  window.addEventListener("hashchange", openHash);
  openHash();
  apply();
})();
"""
