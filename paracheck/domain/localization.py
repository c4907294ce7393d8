"""Typed, torch-free records of a localization: where a failing parity check's difference arises.

One spelling of every field, the JSON report's (docs/reports.md, "Localization"): the rank side builds these
records (`checks.localize`, `checks.stages`, each adapter's localize), writes `to_json()` into a check's
`data["localization"]`, and the host reads them back with `from_json()` into a case's `Localization`, which
the terminal and HTML reports read by attribute. `from_json` never raises on a report from another version:
a field that is not what the schema says reads as absent. An optional field is absent from the JSON when it is
None (or empty, for text), so a record written and read back writes the same JSON.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

def number(value) -> float | None:
    """A figure as a float (NaN and infinity kept), or None where it is missing or not a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def integer(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def ints(value) -> list[int]:
    """The integers in a list (ranks); [] for anything else."""
    return [v for v in value if integer(v) is not None] if isinstance(value, (list, tuple)) else []


def items(value) -> list[dict]:
    """The objects in a list (a report's modules, parameters); [] for anything else."""
    return [v for v in value if isinstance(v, dict)] if isinstance(value, (list, tuple)) else []


def text(value) -> str | None:
    return None if value is None or isinstance(value, (dict, list)) else str(value)


def flag(value) -> bool | None:
    return value if isinstance(value, bool) else None


def _some(out: dict, **fields) -> dict:
    """`out` with each field that is not None."""
    out.update({k: v for k, v in fields.items() if v is not None})
    return out


@dataclass(frozen=True)
class Merged:
    """Where a part was merged over ranks: the rank whose finding is shown, the ranks that found the same, and
    rank (as text) -> what each other rank found instead (`results.localization`)."""
    rank: int | None = None
    ranks: tuple[int, ...] = ()
    other_ranks: dict | None = None

    def to_json(self) -> dict:
        if self.rank is None and not self.ranks and self.other_ranks is None:
            return {}
        return {"rank": self.rank, "ranks": list(self.ranks), "other_ranks": dict(self.other_ranks or {})}

    @classmethod
    def from_json(cls, data: dict) -> "Merged":
        others = data.get("other_ranks")
        return cls(integer(data.get("rank")), tuple(ints(data.get("ranks"))), others if isinstance(others, dict) else None)


@dataclass(frozen=True)
class ModuleRow:
    """One compared module call: its key (`name`, or `name#k` for its k-th call), its output's largest |a - b|
    and that over max |b|, whether every element is within tolerance, why it could not be compared as numbers,
    the reading it agreed under (not the plain concatenation), and the pipeline stage that compared it."""
    module: str
    max_abs: float | None = None
    max_rel: float | None = None
    within: bool | None = None
    why: str = ""
    read_as: str = ""
    stage: int | None = None

    def to_json(self) -> dict:
        out = {"module": self.module, "max_abs": self.max_abs, "max_rel": self.max_rel, "within": self.within}
        return _some(out, why=self.why or None, read_as=self.read_as or None, stage=self.stage)

    @classmethod
    def from_json(cls, data) -> "ModuleRow | None":
        if isinstance(data, str):  # a module named by its key alone
            return cls(data)
        if not isinstance(data, dict):
            return None
        return cls(text(data.get("module")) or "?", number(data.get("max_abs")), number(data.get("max_rel")),
                   flag(data.get("within")), text(data.get("why")) or "", text(data.get("read_as")) or "",
                   integer(data.get("stage")))


@dataclass(frozen=True)
class Skipped:
    """A module call not compared, and why (a shape no split explains, a call on one side only)."""
    module: str
    why: str
    stage: int | None = None

    def to_json(self) -> dict:
        return _some({"module": self.module, "why": self.why}, stage=self.stage)

    @classmethod
    def from_json(cls, data: dict) -> "Skipped":
        return cls(text(data.get("module")) or "?", text(data.get("why")) or "", integer(data.get("stage")))


@dataclass(frozen=True)
class Boundary:
    """A pipeline stage after the first: the first module only it holds, and whether what it was handed agreed."""
    stage: int | None
    module: str
    inputs_within: bool | None
    max_abs: float | None = None

    def to_json(self) -> dict:
        return {"stage": self.stage, "module": self.module, "inputs_within": self.inputs_within,
                "max_abs": self.max_abs}

    @classmethod
    def from_json(cls, data: dict) -> "Boundary":
        return cls(integer(data.get("stage")), text(data.get("module")) or "?", flag(data.get("inputs_within")),
                   number(data.get("max_abs")))


@dataclass(frozen=True)
class ForwardLocalization:
    """One pass's localization, module by module (a forward, a no-grad forward, a backward's trace, a generation,
    a pipeline step): every compared call in execution order (`modules`; None when no trace was made), the
    first beyond tolerance, the last before it that agreed, and `origin`, the module where the difference
    arises; the calls not compared; on a pipeline layout this rank's `stage` and the stages' `boundaries`."""
    modules: tuple[ModuleRow, ...] | None = None
    first: ModuleRow | None = None
    last_agreeing: ModuleRow | None = None
    origin: str | None = None
    not_compared: tuple[Skipped, ...] | None = None
    boundaries: tuple[Boundary, ...] | None = None
    stage: int | None = None
    atol: float | None = None
    rtol: float | None = None
    #: Which pass: "training", "no_grad", "backward", "generate", "step N".
    pass_name: str | None = None
    #: Whether the rerun's output equals the checked pass's (None: not asked).
    reproduced: bool | None = None
    #: A generation's: the cache mode, and the decode step of the first module beyond tolerance.
    mode: str | None = None
    decode_step: int | None = None
    #: A pipeline's: the denoising step traced, and the first step whose latents parted.
    step: int | None = None
    beyond_from: int | None = None
    #: What the diagnosis raised, when it did.
    error: str | None = None
    merged: Merged = Merged()

    @property
    def traced(self) -> bool:
        return self.modules is not None

    def to_json(self) -> dict:
        out = {}
        if self.traced:
            out.update(modules=[m.to_json() for m in self.modules], first=_row(self.first),
                       last_agreeing=_row(self.last_agreeing), origin=self.origin)
        _some(out, not_compared=None if self.not_compared is None else [n.to_json() for n in self.not_compared],
              boundaries=None if self.boundaries is None else [b.to_json() for b in self.boundaries],
              stage=self.stage, atol=self.atol, rtol=self.rtol)
        _some(out, **{"pass": self.pass_name}, reproduced=self.reproduced, mode=self.mode)
        if self.mode is not None or self.decode_step is not None:
            out["decode_step"] = self.decode_step  # a generation says it even where no module parted
        _some(out, step=self.step, beyond_from=self.beyond_from, error=self.error)
        return dict(out, **self.merged.to_json())

    @classmethod
    def from_json(cls, data) -> "ForwardLocalization | None":
        if not isinstance(data, dict):
            return None
        modules = data.get("modules")
        return cls(
            tuple(ModuleRow.from_json(m) for m in items(modules)) if isinstance(modules, list) else None,
            ModuleRow.from_json(data.get("first")), ModuleRow.from_json(data.get("last_agreeing")),
            _name(data.get("origin")),
            _listed(data, "not_compared", Skipped), _listed(data, "boundaries", Boundary),
            integer(data.get("stage")), number(data.get("atol")), number(data.get("rtol")), text(data.get("pass")),
            flag(data.get("reproduced")), text(data.get("mode")), integer(data.get("decode_step")),
            integer(data.get("step")), integer(data.get("beyond_from")), text(data.get("error")),
            Merged.from_json(data))


def _row(row: ModuleRow | None) -> dict | None:
    return None if row is None else row.to_json()


def _name(value) -> str | None:
    """A module's name, given as the name or (another version) as its entry."""
    return ModuleRow.from_json(value).module if isinstance(value, dict) else text(value)


def _listed(data: dict, key: str, record) -> tuple | None:
    value = data.get(key)
    return tuple(record.from_json(v) for v in items(value)) if isinstance(value, list) else None


@dataclass(frozen=True)
class GradRow:
    """One parameter's gradient error: max_abs, max_rel, whether within tolerance, `over` (the largest
    |a - b| / (atol + rtol |b|); None where there is no figure, infinitely beyond), why it could not be compared
    as numbers, the factor it is off by where one fits, and whether the reference gradient is zero at the
    tolerance (no factor can move it)."""
    param: str
    max_abs: float | None = None
    max_rel: float | None = None
    within: bool | None = None
    over: float | None = None
    why: str = ""
    factor: float | None = None
    reference_zero: bool = False

    @property
    def beyond(self) -> float:
        """`over` to sort by: no figure sorts first."""
        return math.inf if self.over is None else self.over

    def to_json(self) -> dict:
        out = {"param": self.param, "max_abs": self.max_abs, "max_rel": self.max_rel, "within": self.within}
        _some(out, why=self.why or None)
        out["over"] = self.over
        return _some(out, factor=self.factor, reference_zero=True if self.reference_zero else None)

    @classmethod
    def from_json(cls, data: dict) -> "GradRow":
        return cls(text(data.get("param")) or "?", number(data.get("max_abs")), number(data.get("max_rel")),
                   flag(data.get("within")), number(data.get("over")), text(data.get("why")) or "",
                   number(data.get("factor")), data.get("reference_zero") is True)


@dataclass(frozen=True)
class GradsLocalization:
    """Every parameter's gradient error, furthest beyond tolerance first (`params`; None where the part holds
    no table), the one-line `pattern`, and `origin`: where the error enters (`origin_from` says what found it
    when not the table: a backward trace, `backward`)."""
    params: tuple[GradRow, ...] | None = None
    pattern: str | None = None
    origin: str | None = None
    backward: ForwardLocalization | None = None
    origin_from: str | None = None
    error: str | None = None
    merged: Merged = Merged()

    def to_json(self) -> dict:
        out = {}
        if self.params is not None:
            out.update(params=[p.to_json() for p in self.params], pattern=self.pattern, origin=self.origin)
        elif self.origin is not None:
            out["origin"] = self.origin
        _some(out, backward=None if self.backward is None else self.backward.to_json(), origin_from=self.origin_from,
              error=self.error)
        return dict(out, **self.merged.to_json())

    @classmethod
    def from_json(cls, data) -> "GradsLocalization | None":
        if not isinstance(data, dict):
            return None
        params = data.get("params")
        return cls(tuple(GradRow.from_json(p) for p in items(params)) if isinstance(params, list) else None,
                   text(data.get("pattern")), _name(data.get("origin")),
                   ForwardLocalization.from_json(data.get("backward")), text(data.get("origin_from")),
                   text(data.get("error")), Merged.from_json(data))


@dataclass(frozen=True)
class StepsLocalization:
    """A failing parity.steps' first parting step, rerun from where it began: `where` it parts ("forward",
    "gradients", "update"), `origin` (the module or parameter; None for the update), and the step's forward
    trace and, where the gradients part, their table."""
    step: int | None = None
    of: int | None = None
    forward: ForwardLocalization | None = None
    grads: GradsLocalization | None = None
    where: str | None = None
    origin: str | None = None
    error: str | None = None
    merged: Merged = Merged()

    def to_json(self) -> dict:
        out = {"step": self.step}
        _some(out, of=self.of, forward=None if self.forward is None else self.forward.to_json(),
              grads=None if self.grads is None else self.grads.to_json())
        if self.where is not None:
            out.update(where=self.where, origin=self.origin)
        _some(out, error=self.error)
        return dict(out, **self.merged.to_json())

    @classmethod
    def from_json(cls, data) -> "StepsLocalization | None":
        if not isinstance(data, dict):
            return None
        return cls(integer(data.get("step")), integer(data.get("of")),
                   ForwardLocalization.from_json(data.get("forward")), GradsLocalization.from_json(data.get("grads")),
                   text(data.get("where")), _name(data.get("origin")), text(data.get("error")), Merged.from_json(data))


@dataclass(frozen=True)
class Planted:
    """For a control that declares `plants_in`: what the localization named, from which part, and whether it is
    the planted place (`planted_in`: the place the case's planter reported, for a `{planted}` glob)."""
    plants_in: str
    named: str | None
    part: str
    localized: bool
    planted_in: str | None = None

    def to_json(self) -> dict:
        out = {"plants_in": self.plants_in, "named": self.named, "from": self.part, "localized": self.localized}
        return _some(out, planted_in=self.planted_in)

    @classmethod
    def from_json(cls, data) -> "Planted | None":
        if not isinstance(data, dict):
            return None
        return cls(text(data.get("plants_in")) or "", text(data.get("named")), text(data.get("from")) or "",
                   data.get("localized") is True, text(data.get("planted_in")))


#: The forward-like parts of a case's localization, in the order the reports show them, with their titles.
FORWARD_PARTS = (("forward", "Forward"), ("inference", "No-grad forward"), ("generate", "Generation"))


@dataclass(frozen=True)
class Localization:
    """A case's localization: each part where the case has it (the first failing rank's finding, merged over
    ranks), why the case was not rerun with hooks (`not_run`), and a control's `planted` answer."""
    forward: ForwardLocalization | None = None
    inference: ForwardLocalization | None = None
    grads: GradsLocalization | None = None
    generate: ForwardLocalization | None = None
    steps: StepsLocalization | None = None
    not_run: str | None = None
    planted: Planted | None = None

    def __bool__(self) -> bool:
        return any(getattr(self, f) is not None for f in
                   ("forward", "inference", "grads", "generate", "steps", "not_run", "planted"))

    def part(self, name: str):
        return {"forward": self.forward, "inference": self.inference, "grads": self.grads,
                "generate": self.generate, "steps": self.steps}.get(name)

    def forward_parts(self) -> list[tuple[str, str, ForwardLocalization]]:
        """(part, title, finding) for each forward-like part the case has, in the reports' order."""
        return [(name, title, self.part(name)) for name, title in FORWARD_PARTS if self.part(name) is not None]

    def with_planted(self, planted: Planted | None) -> "Localization":
        return replace(self, planted=planted)

    def to_json(self) -> dict:
        out = {}
        for name in ("forward", "inference", "grads", "generate", "steps"):
            if self.part(name) is not None:
                out[name] = self.part(name).to_json()
        _some(out, not_run=self.not_run, planted=None if self.planted is None else self.planted.to_json())
        return out

    @classmethod
    def from_json(cls, data) -> "Localization":
        if not isinstance(data, dict):
            return cls()
        return cls(ForwardLocalization.from_json(data.get("forward")),
                   ForwardLocalization.from_json(data.get("inference")),
                   GradsLocalization.from_json(data.get("grads")), ForwardLocalization.from_json(data.get("generate")),
                   StepsLocalization.from_json(data.get("steps")), text(data.get("not_run")),
                   Planted.from_json(data.get("planted")))
