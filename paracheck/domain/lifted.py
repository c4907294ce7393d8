"""Typed, torch-free records of what a loop's check lifts to its case (`records.TO_CASE`): the error after every step
and the pictures, read from a case's JSON (`Verdict.lifted`) by the HTML report (`results.loopview`).

One spelling of each field, the JSON report's (docs/reports.md: `steps`, `images`, `rank`). `from_lifted` never
raises on a report from another version: a field that is not what the schema says reads as absent.
"""

from __future__ import annotations

from dataclasses import dataclass

from paracheck.domain.localization import integer, items, number


@dataclass(frozen=True)
class StepError:
    """One step of a loop: its largest |difference|, the bound it is held to, and the worst element's difference over
    its own bound (`over` > 1: beyond tolerance)."""
    max_abs: float | None = None
    bound: float | None = None
    over: float | None = None

    @classmethod
    def from_json(cls, data: dict) -> "StepError":
        return cls(number(data.get("max_abs")), number(data.get("bound")), number(data.get("over")))


@dataclass(frozen=True)
class Pictures:
    """The decoded output's first picture, as base64 PNG text: the reference's, the parallel run's and their
    |difference| stretched by `scale` (its largest value, `max_abs`, white); `has_difference`: the report gives a
    difference at all (it has none where the shapes differ)."""
    reference: str | None = None
    parallel: str | None = None
    difference: str | None = None
    has_difference: bool = False
    height: float | None = None
    width: float | None = None
    max_abs: float | None = None
    scale: float | None = None

    @classmethod
    def from_json(cls, data: dict) -> "Pictures":
        def picture(key: str) -> str | None:
            return data.get(key) if isinstance(data.get(key), str) else None

        return cls(picture("reference"), picture("parallel"), picture("difference"), data.get("difference") is not None,
                   number(data.get("height")), number(data.get("width")), number(data.get("max_abs")),
                   number(data.get("scale")))


@dataclass(frozen=True)
class LoopFigures:
    """What a case's checks lifted: the error after each step, the pictures, and the rank they are from."""
    steps: tuple[StepError, ...] = ()
    pictures: Pictures | None = None
    rank: int | None = None

    def __bool__(self) -> bool:
        return bool(self.steps) or self.pictures is not None

    @classmethod
    def from_lifted(cls, lifted: dict) -> "LoopFigures":
        images = lifted.get("images")
        return cls(tuple(StepError.from_json(s) for s in items(lifted.get("steps"))),
                   Pictures.from_json(images) if isinstance(images, dict) else None, integer(lifted.get("rank")))
