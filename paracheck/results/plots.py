"""The HTML report's plots of a case's localization, drawn by matplotlib as inline SVG: the per-module
forward error in execution order and the per-parameter gradient error, both on a log scale with the
tolerance drawn.

matplotlib is optional (the `html` extra) and imported here only, inside the functions, without pyplot:
a `Figure` on the SVG canvas, so no GUI backend is chosen and the process's backend is left alone.
`available()` says whether it can be imported. The data is read defensively (a report may come from
another version): numbers that are missing are left out, exact zeros are drawn a decade below the
rest, on a line saying so, and NaN or infinity above them all, marked. Torch-free.
"""

from __future__ import annotations

import io
import math
import re

from paracheck.domain.localization import ForwardLocalization, GradsLocalization, number

OK_COLOR, BAD_COLOR, UNKNOWN_COLOR, TOL_COLOR = "#2e7d32", "#c62828", "#757575", "#1565c0"
#: Parameters the gradient plot shows (worst first); the rest are counted in its title.
TOP_PARAMS = 20
#: The forward plot's module labels' size (points).
TICK_POINTS = 6.5
#: Module names the forward plot labels before it labels only every k-th (and the first beyond tolerance).
MAX_LABELS = 60


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def forward_svg(forward: ForwardLocalization, prefix: str, title: str = "forward") -> str:
    """Per-module error (max_abs, and max_rel where given) of a forward-like pass called `title`, modules in
    execution order, the tolerance as horizontal lines and the first module beyond it marked. `prefix` keeps
    the SVG's ids apart from every other plot's in the page."""
    modules = forward.modules or ()
    names = [m.module for m in modules]
    atol, rtol = forward.atol, forward.rtol
    labels = _text_inches(names, TICK_POINTS)
    fig, ax = _figure(plot_width=max(5.5, min(15.0, 0.16 * len(names) + 1.5)), plot_height=2.6, left=0.8,
                      bottom=labels + 0.15)
    ax.set_yscale("log")
    xs = list(range(len(names)))
    scale = Scale([m.max_abs for m in modules] + [m.max_rel for m in modules], [atol, rtol])
    ax.set_ylim(*scale.limits)
    ax.autoscale(False)  # the limits are the scale's: autoscaling a log axis to 1e60 overflows
    oks = [m.within for m in modules]
    _series(ax, xs, [m.max_abs for m in modules], oks, scale, "max_abs", "o")
    if any(m.max_rel is not None for m in modules):
        _series(ax, xs, [m.max_rel for m in modules], oks, scale, "max_rel", "x", line=False)
    _tolerance(ax, atol, rtol, scale, horizontal=True)
    first = forward.first.module if forward.first else None
    if first in names:
        ax.axvline(names.index(first), color=BAD_COLOR, linestyle=":", linewidth=1.2,
                   label=f"first beyond tolerance: {first}")
    last = forward.last_agreeing.module if forward.last_agreeing else None
    if last in names:
        ax.axvline(names.index(last), color=OK_COLOR, linestyle=":", linewidth=1.0, label=f"last agreeing: {last}")
    _labels(ax, names, first)
    scale.ticks(ax.yaxis)
    ax.set_xlim(-0.6, max(len(names) - 0.4, 0.6))
    ax.set_ylabel("error vs one device")
    ax.set_title(f"{title}: error per module, in execution order ({len(names)} compared)", loc="left")
    ax.legend(loc="upper left", fontsize=7, framealpha=0.9)
    return _svg(fig, prefix)


def grads_svg(grads: GradsLocalization, atol, rtol, prefix: str, top: int = TOP_PARAMS) -> str:
    """Per-parameter gradient error, the `top` worst as horizontal bars (worst on top, as the report lists
    them), max_rel as crosses, and the grads check's tolerance (`atol`, `rtol`) as vertical lines."""
    params = grads.params or ()
    shown = params[:top]
    names = [p.param for p in shown]
    atol, rtol = number(atol), number(rtol)
    fig, ax = _figure(plot_width=5.0, plot_height=0.22 * len(shown) + 0.3, left=_text_inches(names, 7) + 0.2,
                      bottom=0.55)
    ax.set_xscale("log")
    ys = list(range(len(shown)))
    scale = Scale([p.max_abs for p in shown] + [p.max_rel for p in shown], [atol, rtol])
    ax.set_xlim(*scale.limits)
    ax.set_ylim(len(shown) - 0.5, -0.5)
    ax.autoscale(False)
    values = [scale.place(p.max_abs) for p in shown]
    left = scale.limits[0]
    ax.barh(ys, [v - left if v is not None else 0 for v in values], left=left,
            color=[_color(p.within) for p in shown], height=0.65, label="max_abs")
    rel = [scale.place(p.max_rel) for p in shown]
    if any(r is not None for r in rel):
        ax.scatter([r for r in rel if r is not None], [y for y, r in zip(ys, rel) if r is not None], marker="x",
                   color="#212121", s=14, zorder=3, label="max_rel")
    _marks(ax, [p.max_abs for p in shown], ys, scale, horizontal=False)
    _tolerance(ax, atol, rtol, scale, horizontal=False)
    scale.ticks(ax.xaxis)
    ax.set_yticks(ys, names, fontsize=7)
    ax.set_xlabel("error vs one device")
    more = f" (worst {len(shown)} of {len(params)})" if len(params) > len(shown) else f" ({len(params)})"
    ax.set_title("gradients: error per parameter" + more, loc="left")
    ax.legend(loc="lower right", fontsize=7, framealpha=0.9)
    return _svg(fig, prefix)


def _figure(plot_width: float, plot_height: float, left: float, bottom: float, top: float = 0.3,
            right: float = 0.2):
    """A figure whose axes are `plot_width` x `plot_height` inches with the margins given (inches): laid out
    from the labels' lengths, since a tight bounding box would draw every figure twice."""
    from matplotlib.backends.backend_svg import FigureCanvasSVG
    from matplotlib.figure import Figure

    width, height = left + plot_width + right, bottom + plot_height + top
    fig = Figure(figsize=(width, height), dpi=72)
    FigureCanvasSVG(fig)
    fig.subplots_adjust(left=left / width, right=1 - right / width, bottom=bottom / height, top=1 - top / height)
    return fig, fig.add_subplot()


def _text_inches(names: list[str], points: float) -> float:
    """About how long the longest of `names` is in DejaVu Sans at `points` (0.6 em a character, a little
    wide, so a label is never cut)."""
    return max((len(n) for n in names), default=1) * points * 0.6 / 72


class Scale:
    """A log axis for some figures and tolerances: it spans the finite positive ones (a decade around 1e-6
    where there are none), an exact zero is drawn a decade below them all, NaN and infinity above."""

    def __init__(self, values, tolerances):
        finite = [v for v in map(number, list(values) + list(tolerances)) if v is not None and math.isfinite(v)
                  and v > 0]
        self.low, self.high = (min(finite), max(finite)) if finite else (1e-7, 1e-5)
        # Past 1e+-60 nothing is read off a plot, and log axes near the float limits overflow.
        self.low, self.high = max(self.low, 1e-60), min(max(self.high, 1e-60), 1e60)
        self.zeros = any(number(v) == 0 for v in values)
        # Half a decade off the decades, so the zero tick never sits on one.
        self.zero, self.over = self.low / 10 ** 1.5, self.high * 10

    @property
    def limits(self) -> tuple[float, float]:
        return self.zero / 3, self.over * 3

    def ticks(self, axis) -> None:
        """Decade ticks, and the exact zeros' level ticked `0` where some figure is zero."""
        lo, hi = self.limits
        # Below the smallest figure only the zeros' tick, so no decade crowds it.
        bottom = self.low * (1 - 1e-9) if self.zeros else lo
        decades = list(range(math.ceil(math.log10(bottom)), math.floor(math.log10(hi)) + 1))
        step = max(1, math.ceil(len(decades) / 8))
        ticks = [10.0 ** k for k in decades[::step]]
        labels = [f"$10^{{{k}}}$" for k in decades[::step]]
        if self.zeros:
            ticks, labels = [self.zero] + ticks, ["0"] + labels
        axis.set_ticks(ticks, labels)
        axis.set_minor_locator(_null_locator())

    def place(self, value) -> float | None:
        """Where a figure is drawn: itself, zero at `zero`, NaN or infinity at `over`; None: not drawn."""
        v = number(value)
        if v is None:
            return None
        if not math.isfinite(v):
            return self.over
        return min(max(v, self.low), self.over) if v > 0 else self.zero


def _null_locator():
    from matplotlib.ticker import NullLocator

    return NullLocator()


def _color(ok) -> str:
    return OK_COLOR if ok is True else BAD_COLOR if ok is False else UNKNOWN_COLOR


def _series(ax, xs, values, oks, scale: Scale, label: str, marker: str, line: bool = True) -> None:
    placed = [scale.place(v) for v in values]
    drawn = [(x, p, ok) for x, p, ok in zip(xs, placed, oks) if p is not None]
    if line and drawn:
        ax.plot([x for x, _, _ in drawn], [p for _, p, _ in drawn], color="#9e9e9e", linewidth=0.8, zorder=1)
    if drawn:
        ax.scatter([x for x, _, _ in drawn], [p for _, p, _ in drawn], c=[_color(ok) for _, _, ok in drawn],
                   marker=marker, s=18 if line else 14, zorder=2, label=label)
    if line:
        _marks(ax, values, xs, scale, horizontal=True)


def _marks(ax, values, positions, scale: Scale, horizontal: bool) -> None:
    """Label the exact zeros (drawn at the bottom) and mark NaN and infinity (at the top) with a triangle."""
    figures = [(p, number(v)) for p, v in zip(positions, values) if number(v) is not None]
    zeros = [p for p, v in figures if v == 0]
    bad = [p for p, v in figures if not math.isfinite(v)]
    line = ax.axhline if horizontal else ax.axvline
    if zeros:
        line(scale.zero, color="#bdbdbd", linewidth=0.8, linestyle="-", zorder=0)
    if bad:
        at = [scale.over] * len(bad)
        xs, ys = (bad, at) if horizontal else (at, bad)
        ax.scatter(xs, ys, marker="^" if horizontal else ">", color=BAD_COLOR, s=40, zorder=4, label="nan or inf")


def _tolerance(ax, atol, rtol, scale: Scale, horizontal: bool) -> None:
    """The tolerance as lines (kept on the axis however far off it is; the label says its value)."""
    axis_line = ax.axhline if horizontal else ax.axvline

    def line(value, **style):
        axis_line(min(max(value, scale.low), scale.high), **style)

    if atol is not None and math.isfinite(atol) and atol > 0:
        same = rtol is not None and math.isclose(atol, rtol)
        line(atol, color=TOL_COLOR, linestyle="--", linewidth=1.0,
             label=f"atol = rtol = {atol:.0e}" if same else f"atol {atol:.0e}")
        if same:
            return
    if rtol is not None and math.isfinite(rtol) and rtol > 0:
        line(rtol, color=TOL_COLOR, linestyle="-.", linewidth=0.9, label=f"rtol {rtol:.0e} (for max_rel)")


def _labels(ax, names: list[str], first) -> None:
    step = max(1, math.ceil(len(names) / MAX_LABELS))
    ticks = [i for i, n in enumerate(names) if i % step == 0 or n == first]
    ax.set_xticks(ticks, [names[i] for i in ticks], rotation=90, fontsize=TICK_POINTS)
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
        fig.savefig(buffer, format="svg",
                    metadata={"Creator": None, "Date": None, "Format": None, "Type": None})
    text = buffer.getvalue()
    text = text[text.index("<svg"):]
    # Smaller, the same drawing: no indentation between elements, and the sans-serif fallback list that
    # every label repeats cut to three names.
    text = re.sub(r">\s+<", "><", text)
    text = re.sub(r"font-family: '[^;\"]*sans-serif", "font-family: 'DejaVu Sans', Arial, sans-serif", text)
    text = re.sub(r'\s+xmlns(:xlink)?="[^"]*"', "", text, count=2)
    referenced = set(re.findall(r'(?:href="#|url\(#)([^")]+)', text))
    text = re.sub(r' id="([^"]+)"', lambda m: f' id="{prefix}-{m.group(1)}"' if m.group(1) in referenced else "",
                  text)
    text = re.sub(r'(href="#|url\(#)([^")]+)', lambda m: f"{m.group(1)}{prefix}-{m.group(2)}", text)
    return text.replace("<svg ", '<svg class="plot" role="img" ', 1)
