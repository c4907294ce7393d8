"""The HTML report's plots of a case's localization, drawn by matplotlib as inline SVG: the per-module
forward error in execution order and the per-parameter gradient error, both on a log scale with the
tolerance drawn.

matplotlib is optional (the `html` extra) and imported here only, inside the functions, without pyplot:
a `Figure` on the SVG canvas, so no GUI backend is chosen and the process's backend is left alone.
`available()` says whether it can be imported. The data is read defensively (a report may come from
another version): numbers that are missing are left out, zeros are drawn at the floor, and NaN or
infinity at the top, marked. Torch-free.
"""

from __future__ import annotations

import io
import math
import re

OK_COLOR, BAD_COLOR, UNKNOWN_COLOR, TOL_COLOR = "#2e7d32", "#c62828", "#757575", "#1565c0"
#: Parameters the gradient plot shows (worst first); the rest are counted in its title.
TOP_PARAMS = 20
#: Module names the forward plot labels before it labels only every k-th (and the first beyond tolerance).
MAX_LABELS = 60


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def number(value) -> float | None:
    """A figure as a float (NaN and infinity kept), or None where it is missing or not a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def items(value) -> list[dict]:
    """The objects in a list (a report's list of modules, parameters, checks); [] for anything else."""
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def ints(value) -> list[int]:
    """The integers in a list (ranks); [] for anything else."""
    return [v for v in value if isinstance(v, int) and not isinstance(v, bool)] if isinstance(value, list) else []


def forward_svg(forward: dict, prefix: str) -> str:
    """Per-module forward error (max_abs, and max_rel where given), modules in execution order, the
    tolerance as horizontal lines and the first module beyond it marked. `prefix` keeps the SVG's ids apart
    from every other plot's in the page."""
    modules = items(forward.get("modules"))
    names = [str(m.get("name", "?")) for m in modules]
    atol, rtol = number(forward.get("atol")), number(forward.get("rtol"))
    fig, ax = _figure(width=max(6.4, min(16.0, 0.16 * len(names) + 2.5)), height=3.4)
    xs = list(range(len(names)))
    floor, top = _range([m.get("max_abs") for m in modules] + [m.get("max_rel") for m in modules], [atol, rtol])
    _series(ax, xs, [m.get("max_abs") for m in modules], [m.get("ok") for m in modules], floor, top, "max_abs", "o")
    if any(number(m.get("max_rel")) is not None for m in modules):
        _series(ax, xs, [m.get("max_rel") for m in modules], [m.get("ok") for m in modules], floor, top, "max_rel",
                "x", line=False)
    _tolerance(ax, atol, rtol, horizontal=True)
    first = forward.get("first")
    if first in names:
        i = names.index(first)
        ax.axvline(i, color=BAD_COLOR, linestyle=":", linewidth=1.2, label=f"first beyond tolerance: {first}")
    last = forward.get("last_agreeing")
    if last in names:
        ax.axvline(names.index(last), color=OK_COLOR, linestyle=":", linewidth=1.0, label=f"last agreeing: {last}")
    _labels(ax, names, first)
    ax.set_ylim(floor / 2, top * 3)
    ax.set_xlim(-0.6, max(len(names) - 0.4, 0.6))
    ax.set_ylabel("error vs one device")
    ax.set_title(f"forward: error per module, in execution order ({len(names)} compared)", loc="left")
    ax.legend(loc="upper left", fontsize=7, framealpha=0.9)
    return _svg(fig, prefix)


def grads_svg(grads: dict, atol, rtol, prefix: str, top: int = TOP_PARAMS) -> str:
    """Per-parameter gradient error, the `top` worst as horizontal bars (worst on top, as the report lists
    them), max_rel as crosses, and the grads check's tolerance (`atol`, `rtol`) as vertical lines."""
    params = items(grads.get("params"))
    shown = params[:top]
    names = [str(p.get("name", "?")) for p in shown]
    atol, rtol = number(atol), number(rtol)
    fig, ax = _figure(width=7.5, height=0.22 * len(shown) + 1.3)
    ys = list(range(len(shown)))
    floor, ceiling = _range([p.get("max_abs") for p in shown] + [p.get("max_rel") for p in shown], [atol, rtol])
    values = [_placed(p.get("max_abs"), floor, ceiling) for p in shown]
    colors = [_color(p.get("ok")) for p in shown]
    ax.barh(ys, [v if v is not None else 0 for v in values], left=floor / 2, color=colors, height=0.65,
            label="max_abs")
    rel = [_placed(p.get("max_rel"), floor, ceiling) for p in shown]
    if any(r is not None for r in rel):
        ax.scatter([r for r in rel if r is not None], [y for y, r in zip(ys, rel) if r is not None], marker="x",
                   color="#212121", s=14, zorder=3, label="max_rel")
    _offscale(ax, [p.get("max_abs") for p in shown], ys, ceiling, horizontal=False)
    _tolerance(ax, atol, rtol, horizontal=False)
    ax.set_xscale("log")
    ax.set_xlim(floor / 2, ceiling * 3)
    ax.set_yticks(ys, names, fontsize=7)
    ax.set_ylim(len(shown) - 0.5, -0.5)
    ax.set_xlabel("error vs one device")
    more = f" (worst {len(shown)} of {len(params)})" if len(params) > len(shown) else f" ({len(params)})"
    ax.set_title("gradients: error per parameter" + more, loc="left")
    ax.legend(loc="lower right", fontsize=7, framealpha=0.9)
    return _svg(fig, prefix)


def _figure(width: float, height: float):
    from matplotlib.backends.backend_svg import FigureCanvasSVG
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=72)
    FigureCanvasSVG(fig)
    return fig, fig.add_subplot()


def _range(values, tolerances) -> tuple[float, float]:
    """The finite positive span the axis shows: the figures and the tolerances, or a decade around 1e-6."""
    finite = [v for v in map(number, values + tolerances) if v is not None and math.isfinite(v) and v > 0]
    if not finite:
        return 1e-7, 1e-5
    return min(finite), max(finite)


def _placed(value, floor: float, ceiling: float) -> float | None:
    """Where a figure is drawn: itself, zero at the floor, NaN or infinity at the ceiling."""
    v = number(value)
    if v is None:
        return None
    if not math.isfinite(v):
        return ceiling * 2
    return v if v > 0 else floor / 1.5


def _color(ok) -> str:
    return OK_COLOR if ok is True else BAD_COLOR if ok is False else UNKNOWN_COLOR


def _series(ax, xs, values, oks, floor, top, label, marker, line=True) -> None:
    placed = [_placed(v, floor, top) for v in values]
    if line:
        ax.plot([x for x, p in zip(xs, placed) if p is not None], [p for p in placed if p is not None],
                color="#9e9e9e", linewidth=0.8, zorder=1)
    ax.scatter([x for x, p in zip(xs, placed) if p is not None], [p for p in placed if p is not None],
               c=[_color(ok) for ok, p in zip(oks, placed) if p is not None], marker=marker, s=18 if line else 14,
               zorder=2, label=label)
    _offscale(ax, values, xs, top, horizontal=True)
    ax.set_yscale("log")


def _offscale(ax, values, positions, ceiling, horizontal: bool) -> None:
    """NaN and infinity, drawn at the top of the axis as a marked triangle."""
    bad = [p for p, v in zip(positions, values) if number(v) is not None and not math.isfinite(number(v))]
    if bad:
        xs, ys = (bad, [ceiling * 2] * len(bad)) if horizontal else ([ceiling * 2] * len(bad), bad)
        ax.scatter(xs, ys, marker="^" if horizontal else ">", color=BAD_COLOR, s=40, zorder=4, label="nan or inf")


def _tolerance(ax, atol, rtol, horizontal: bool) -> None:
    line = ax.axhline if horizontal else ax.axvline
    if atol is not None and atol > 0:
        same = rtol is not None and math.isclose(atol, rtol)
        line(atol, color=TOL_COLOR, linestyle="--", linewidth=1.0,
             label=f"atol = rtol = {atol:.0e}" if same else f"atol {atol:.0e}")
        if same:
            return
    if rtol is not None and rtol > 0:
        line(rtol, color=TOL_COLOR, linestyle="-.", linewidth=0.9, label=f"rtol {rtol:.0e} (for max_rel)")


def _labels(ax, names: list[str], first) -> None:
    step = max(1, math.ceil(len(names) / MAX_LABELS))
    ticks = [i for i, n in enumerate(names) if i % step == 0 or n == first]
    ax.set_xticks(ticks, [names[i] for i in ticks], rotation=90, fontsize=6.5)
    for tick, i in zip(ax.get_xticklabels(), ticks):
        if names[i] == first:
            tick.set_color(BAD_COLOR)
            tick.set_fontweight("bold")


def _svg(fig, prefix: str) -> str:
    """The figure as an `<svg>` element to inline: no XML prolog or DOCTYPE, no namespace URLs (inline SVG
    in HTML needs none), and its ids prefixed so two plots in one page never share one."""
    import matplotlib

    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": prefix}):
        fig.savefig(buffer, format="svg", bbox_inches="tight",
                    metadata={"Creator": None, "Date": None, "Format": None, "Type": None})
    text = buffer.getvalue()
    text = text[text.index("<svg"):]
    text = re.sub(r'\s+xmlns(:xlink)?="[^"]*"', "", text, count=2)
    referenced = set(re.findall(r'(?:href="#|url\(#)([^")]+)', text))
    text = re.sub(r' id="([^"]+)"', lambda m: f' id="{prefix}-{m.group(1)}"' if m.group(1) in referenced else "",
                  text)
    text = re.sub(r'(href="#|url\(#)([^")]+)', lambda m: f"{m.group(1)}{prefix}-{m.group(2)}", text)
    return text.replace("<svg ", f'<svg class="plot" role="img" ', 1)
