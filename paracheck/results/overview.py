"""The picture at the top of every HTML report: models by layouts, each cell coloured by the status of its cases,
linking to its case, so a reader sees the whole run at a glance.

A cell holds every case of its model and layout (routes, variants, controls); it shows the status that needs a look
first (`ORDER`), how many cases it holds, and links to the first case with that status (the page opens a linked
case's row whatever the filters). It reads each case's `grouping.Row`. Torch-free, pure.
"""

from __future__ import annotations

from html import escape

from paracheck.results.grouping import Row

#: What needs a look first; a cell shows the first of these its cases have.
ORDER = ("fail", "error", "missed", "xpass", "xfail", "inconclusive", "pass", "detected", "skip")


def _e(value) -> str:
    return escape("" if value is None else str(value), quote=True)


def cell_status(statuses: list[str]) -> str:
    """The status a cell of cases with `statuses` shows: the first of `ORDER` among them (an unknown one last)."""
    known = [s for s in ORDER if s in statuses]
    return known[0] if known else (statuses[0] if statuses else "")


def cells(cases: list[Row], order: list[Row] | None = None) -> tuple[list[str], list[str], dict]:
    """(models, layouts, (model, layout) -> [row]): models and layouts in the order `order` (the run's order; default
    `cases`') first names them, each cell's cases in the order of `cases`."""
    models, layouts, held = [], [], {}
    for case in order if order is not None else cases:
        models += [case.model] if case.model not in models else []
        layouts += [case.layout] if case.layout not in layouts else []
    for case in cases:
        held.setdefault((case.model, case.layout), []).append(case)
    return models, layouts, held


def grid(cases: list[Row], anchor, order: list[Row] | None = None) -> str:
    """The section: a table of models (rows) by layouts (columns), in the run's order (`order`); `anchor(row)` names
    the page's row of a case."""
    if not cases:
        return ""
    models, layouts, held = cells(cases, order)
    head = "".join(f'<th scope="col">{_e(layout)}</th>' for layout in layouts)
    rows = []
    for model in models:
        tds = []
        for layout in layouts:
            members = held.get((model, layout), [])
            if not members:
                tds.append('<td class="cell empty"></td>')
                continue
            status = cell_status([c.status for c in members])
            shown = next(c for c in members if c.status == status)
            counts = {}
            for c in members:
                counts[c.status] = counts.get(c.status, 0) + 1
            ranked = sorted(counts.items(), key=lambda sn: ORDER.index(sn[0]) if sn[0] in ORDER else len(ORDER))
            title = f"{model} {layout}: " + ", ".join(f"{n} {s}" for s, n in ranked)
            extra = f' <span class="more">+{len(members) - 1}</span>' if len(members) > 1 else ""
            tds.append(f'<td class="cell c-{_e(status)}" data-model="{_e(model)}" data-layout="{_e(layout)}">'
                       f'<a href="#{_e(anchor(shown))}" title="{_e(title)}">{_e(status)}{extra}</a></td>')
        rows.append(f'<tr><th scope="row">{_e(model)}</th>{"".join(tds)}</tr>')
    return ('<section id="overview"><h2>The run at a glance</h2><table class="grid" id="grid"><thead><tr>'
            f'<th></th>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table></section>')


CSS = """
table.grid{margin:.3em 0 .8em;font-size:.9em}table.grid th{background:none;position:static}
table.grid td.cell{padding:0;text-align:center;min-width:4.2em;border:2px solid #fff}
table.grid td.cell a{display:block;padding:.25em .4em;color:inherit;text-decoration:none;font-weight:600}
table.grid td.cell a:hover{outline:2px solid #424242}.grid .more{font-weight:400;font-size:.85em;opacity:.8}
.c-fail,.c-error,.c-missed{background:#ef9a9a}.c-xpass{background:#ffcc80}.c-xfail{background:#ce93d8}
.c-pass,.c-detected{background:#a5d6a7}.c-inconclusive,.c-skip{background:#e0e0e0}td.cell.empty{background:#fafafa}
"""
