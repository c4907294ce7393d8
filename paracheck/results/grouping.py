"""The report's groupings, built once for every renderer: known failures, skips by reason, never-runnable layouts.

The terminal notes group `Verdict`s; the HTML report groups a JSON report's cases (`paracheck report` renders a
file), each read back into its `Verdict` (`Verdict.from_json`). Both read each verdict into a `Row`, the fields a
grouping needs with one spelling, and then share `groups()`, so a grouping rule is written, and changed, once.
"""

from __future__ import annotations

from dataclasses import dataclass


#: Each case status (as JSON spells it) and its word in a count, in the order the counts line says them.
COUNTED = {"pass": "passed", "fail": "failed", "error": "errors", "skip": "skipped", "detected": "detected",
           "missed": "missed", "inconclusive": "inconclusive", "xfail": "xfailed", "xpass": "xpassed"}


def counts(statuses) -> dict[str, int]:
    """How many cases have each status: every status of `COUNTED` (0 where none), then any other a report holds,
    in the order first seen. The terminal's counts line, the JSON summary, JUnit and the HTML badges count by it."""
    out = dict.fromkeys(COUNTED, 0)
    for status in statuses:
        out[status] = out.get(status, 0) + 1
    return out


@dataclass(frozen=True)
class Row:
    """One case as the groupings read it. `index`: its place in the run (renderers link by it); `plain`: what
    identifies its plain case (a control's skip folds into its plain case's)."""
    index: int
    id: str
    model: str
    variant: str
    dtype: str
    layout: str
    route: str
    control: str | None
    status: str
    reason: str
    known: str | None
    missing_plan: str | None
    plain: tuple

    @classmethod
    def of_verdict(cls, index: int, v) -> "Row":
        c = v.case
        return cls(index, v.id, c.model, c.variant, c.dtype, c.layout.name, v.route.value, c.control, v.status.value,
                   v.reason, v.known, v.failure.missing_plan if v.failure else None,
                   (c.model, c.layout.name, c.layout.order, v.route.value, c.variant, c.dtype))

    @property
    def who(self) -> str:
        return who(self.model, self.variant, self.dtype)

    @property
    def label(self) -> str:
        extra = [x for x in (self.variant if self.variant != "base" else "", self.dtype if self.dtype != "fp32"
                             else "") if x]
        return f"{self.model} {self.layout} {self.route}" + (f" {'/'.join(extra)}" if extra else "") + \
            (f" [{self.control}]" if self.control else "")


@dataclass(frozen=True)
class Group:
    """Cases one line of the report stands for. `kind`: "xfail" (a known failure: `title` is the entry),
    "xpass" (a declared failure that passed), "skip" (plain cases skipped for the reason `title`),
    "skip-controls" (controls skipped on their own for the reason `title`; `controls`: control -> models),
    "never" (models that lack the plan `title` for the layouts `layouts`)."""
    kind: str
    title: str
    rows: tuple[Row, ...] = ()
    controls: tuple[tuple[str, tuple[str, ...]], ...] = ()
    models: tuple[str, ...] = ()
    layouts: tuple[str, ...] = ()

    @property
    def covers(self) -> str:
        """The rows compactly, model x layouts (`covered`)."""
        return covered(self.rows)

    @property
    def never_line(self) -> str:
        return f"{', '.join(self.models)}: no {self.title}, so {', '.join(self.layouts)} cannot run"


def groups(rows: list[Row]) -> list[Group]:
    """Known failures (xfails by entry, then declared ones that passed), the skips by reason (a control whose
    plain case was skipped folds into it; a control skipped on its own is listed by control and model), then the
    models that can never take a kind of layout, each model's layouts once whatever the variants."""
    known: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        if r.status in ("xfail", "xpass"):
            known.setdefault((r.status, r.known or r.reason), []).append(r)
    out = [Group(kind, title, tuple(members)) for (kind, title), members in known.items()]
    skipped = [r for r in rows if r.status == "skip"]
    plain_skipped = {r.plain for r in skipped if not r.control}
    reasons: dict[str, list[Row]] = {}
    controls: dict[str, dict[str, list[str]]] = {}
    never: dict[tuple[str, str], list[str]] = {}
    for r in skipped:
        if r.missing_plan:
            layouts = never.setdefault((r.model, r.missing_plan), [])
            if r.layout not in layouts:
                layouts.append(r.layout)
        elif r.control and r.plain in plain_skipped:
            continue
        elif r.control:
            models = controls.setdefault(r.reason, {}).setdefault(r.control, [])
            if r.model not in models:
                models.append(r.model)
        else:
            reasons.setdefault(r.reason, []).append(r)
    out += [Group("skip", reason, tuple(members)) for reason, members in reasons.items()]
    out += [Group("skip-controls", reason, controls=tuple((c, tuple(ms)) for c, ms in by.items()))
            for reason, by in controls.items()]
    alike: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for (model, plan), layouts in never.items():
        alike.setdefault((plan, tuple(layouts)), []).append(model)
    out += [Group("never", plan, models=tuple(ms), layouts=layouts) for (plan, layouts), ms in alike.items()]
    return out


def covered(rows) -> str:
    """Rows compactly, model (with its variant or dtype where not the default) x layouts (`models_by_layouts`).
    A layout one model runs by several routes is named with each route."""
    by_model: dict[str, list[Row]] = {}
    for r in rows:
        by_model.setdefault(r.who, []).append(r)
    pairs = []
    for model, members in by_model.items():
        names = [r.layout for r in members]
        if len(set(names)) < len(names):
            names = [f"{r.layout} {r.route}" for r in members]
        pairs += [(model, name) for name in names]
    return models_by_layouts(pairs)


def who(model: str, variant: str | None, dtype: str | None) -> str:
    """A model with its variant and dtype where they are not the defaults: `qwenimage masked bf16`."""
    return " ".join([str(model)] + [str(x) for x in (variant if variant not in (None, "base") else "",
                                                     dtype if dtype not in (None, "fp32") else "") if x])


def models_by_layouts(pairs) -> str:
    """(model, layout) pairs as `flux, wan: r4, tp2xr2; qwenimage masked: r4`: each model's layouts once, in
    order, and models with the same layouts together."""
    layouts: dict[str, list[str]] = {}
    for model, layout in pairs:
        if layout not in layouts.setdefault(model, []):
            layouts[model].append(layout)
    models: dict[tuple[str, ...], list[str]] = {}
    for model, names in layouts.items():
        models.setdefault(tuple(names), []).append(model)
    return "; ".join(f"{', '.join(ms)}: {', '.join(names)}" for names, ms in models.items())
