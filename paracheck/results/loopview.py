"""What the HTML report shows of a case whose checks lift a loop's figures (`records.TO_CASE`): the reference, the
parallel and the difference pictures side by side (`images`), and the error after every step with the bound it is
held to (`steps`), as an inline SVG drawn here (no plotting library), on a log scale.

The JSON a case carries: `steps`, a list of `{max_abs, bound, over}` per step (`over`: the worst element's
|difference| over its own bound, > 1 beyond tolerance), `images`: `{reference, parallel, difference}` as base64 PNG
with `height`, `width`, `max_abs`, `scale`, and `rank`, the rank they are from; read into typed records
(`domain.lifted.LoopFigures`), which read what is not the schema's as absent. Torch-free.
"""

from __future__ import annotations

import math
import re
import sys
from html import escape

from paracheck.domain.lifted import LoopFigures, Pictures, StepError
from paracheck.domain.localization import number

#: What a picture must be to be shown: base64 text (anything else in a report is left out).
BASE64 = re.compile(r"^[A-Za-z0-9+/]+={0,2}$")
#: The pictures' shown size (CSS pixels of the longer side; tiny outputs are enlarged, pixels kept square).
SHOWN = 160
OK_COLOR, BAD_COLOR, BOUND_COLOR = "#2e7d32", "#c62828", "#1565c0"


def _e(value) -> str:
    return escape("" if value is None else str(value), quote=True)


def has_view(lifted: dict) -> bool:
    return bool(LoopFigures.from_lifted(lifted))


def section(lifted: dict, prefix: str) -> str:
    """The pictures and step curve a case's checks lifted (`Verdict.lifted`; empty when it carries neither)."""
    figures = LoopFigures.from_lifted(lifted)
    if not figures:
        return ""
    parts = ['<div class="loopview">']
    if figures.pictures is not None:
        parts.append(_pictures(figures.pictures, figures.rank))
    if figures.steps:
        parts.append(f'<h3>Error after each step{_rank(figures.rank)}</h3>'
                     f'<figure class="step-plot">{curve_svg(figures.steps, prefix)}</figure>{_table(figures.steps)}')
    return "\n".join(parts) + "</div>"


def _rank(rank: int | None) -> str:
    return f" (rank {rank}, the worst)" if rank is not None else ""


def _pictures(images: Pictures, rank: int | None) -> str:
    height, width = images.height or 1, images.width or 1
    factor = max(1, int(SHOWN // max(height, width)))
    size = f'width="{int(width * factor)}" height="{int(height * factor)}"'
    shown = [("reference", "reference (one device)", images.reference),
             ("parallel", f"parallel{_rank(rank)}", images.parallel)]
    worst = images.max_abs
    if images.has_difference:
        stretch = images.scale
        what = (f"|difference|, x{stretch:.3g} (largest {worst:.2e})" if stretch else "|difference|: none")
        shown.append(("difference", what, images.difference))
    figures = []
    for key, caption, data in shown:
        if data is None or not BASE64.match(data):
            continue
        figures.append(f'<figure class="picture {key}"><img alt="{_e(caption)}" {size} '
                       f'src="data:image/png;base64,{_e(data)}"><figcaption>{_e(caption)}</figcaption></figure>')
    return f'<h3>Output</h3><div class="pictures">{"".join(figures)}</div>'


def _table(steps: tuple[StepError, ...]) -> str:
    rows = "".join(
        f'<tr><td class="num">{i + 1}</td><td class="num">{_num(s.max_abs)}</td>'
        f'<td class="num">{_num(s.bound)}</td><td class="num">{_num(s.over, ".2f")}</td></tr>'
        for i, s in enumerate(steps))
    return ('<details><summary>every step</summary><table class="steps"><thead><tr><th>step</th><th>max_abs</th>'
            f'<th>bound</th><th>over</th></tr></thead><tbody>{rows}</tbody></table></details>')


def _num(value, spec: str = ".1e") -> str:
    v = number(value)
    return "" if v is None else _e(format(v, spec))


def _log(value: float | None, floor: float) -> float:
    return math.log10(max(value, floor)) if value is not None and math.isfinite(value) else math.log10(floor)


def curve_svg(steps: tuple[StepError, ...], prefix: str, width: int = 480, height: int = 200) -> str:
    """max_abs per step (a point each: red beyond its bound, `over` > 1) and the bound (dashed), log y."""
    values = [s.max_abs for s in steps]
    bounds = [s.bound for s in steps]
    seen = [v for v in values + bounds if v is not None and v > 0 and math.isfinite(v)]
    if not seen:
        return '<p class="note">no step has a figure to draw</p>'
    floor = max(min(seen) / 10, sys.float_info.min)
    low, high = math.floor(_log(min(seen), floor)) - 1, math.ceil(_log(max(seen), floor))
    left, right, top, bottom = 56, 12, 12, 34
    span = max(1, len(steps) - 1)

    def x(i: int) -> float:
        return left + (width - left - right) * (i / span if len(steps) > 1 else 0.5)

    def y(v: float | None) -> float:
        return top + (height - top - bottom) * (high - _log(v, floor)) / max(high - low, 1)

    parts = [f'<svg class="plot curve" id="{_e(prefix)}-curve" xmlns="http://www.w3.org/2000/svg" '
             f'viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
             f'aria-label="error after each step, log scale">']
    for decade in range(low, high + 1):
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(10.0 ** decade):.1f}" y2="{y(10.0 ** decade):.1f}"'
                     f' stroke="#eeeeee"/><text x="{left - 4}" y="{y(10.0 ** decade) + 3:.1f}" font-size="9" '
                     f'text-anchor="end">1e{decade}</text>')
    if any(b is not None for b in bounds):
        path = " ".join(f"{x(i):.1f},{y(b):.1f}" for i, b in enumerate(bounds) if b is not None)
        parts.append(f'<polyline class="bound" points="{path}" fill="none" stroke="{BOUND_COLOR}" '
                     'stroke-dasharray="5,3"/>')
    path = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(values) if v is not None)
    parts.append(f'<polyline class="error" points="{path}" fill="none" stroke="#424242"/>')
    for i, (step, v) in enumerate(zip(steps, values)):
        beyond = (step.over or 0.0) > 1
        parts.append(f'<circle class="{"beyond" if beyond else "within"}" cx="{x(i):.1f}" cy="{y(v):.1f}" r="3.5" '
                     f'fill="{BAD_COLOR if beyond else OK_COLOR}"><title>step {i + 1}: max_abs {_num(v)}</title>'
                     '</circle>')
        parts.append(f'<text x="{x(i):.1f}" y="{height - bottom + 14}" font-size="9" text-anchor="middle">{i + 1}</text>')
    parts.append(f'<text x="{(left + width - right) / 2:.1f}" y="{height - 4}" font-size="10" text-anchor="middle">'
                 'denoising step (dashed: the bound at its largest reference value)</text></svg>')
    return "".join(parts)


CSS = """
.pictures{display:flex;gap:1.2em;flex-wrap:wrap;align-items:flex-start}
.pictures figure{margin:.2em 0;text-align:center}.pictures img{image-rendering:pixelated;border:1px solid #bdbdbd;
 background:#000}.pictures figcaption{font-size:.85em;color:#616161;max-width:14em}
table.steps{font-size:.9em}
"""
