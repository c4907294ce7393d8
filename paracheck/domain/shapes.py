"""Input shapes: what a fixture builds (batch, lengths, masks, timesteps), and the space `explore` draws from.

A `Shape` is the input side of a case, independent of model and layout: the named variants (`base`,
`batch2`, `masked`, `uneven`) are four particular shapes, and `paracheck explore` draws others. A `Space`
says which shapes a model takes: its length axes with their base and uneven lengths and the range
explore may draw, whether it takes a text mask, and how many samples. Torch-free and JSON-able, so a
shape travels inside a case and into a found case's replay file.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: `Shape.padded` value of the named `masked` variant: sample 0 unmasked, the last third of sample 1's text.
THIRD = -3


@dataclass(frozen=True)
class Axis:
    """One length a model's inputs have: its base value, its uneven-variant value, explore's range."""
    even: int
    odd: int
    low: int = 1
    high: int = 0  # 0: the base value
    #: explore draws low, low + step, ... (a patch size the length must be a multiple of, in other units)
    step: int = 1

    def __post_init__(self):
        if not self.high:
            object.__setattr__(self, "high", max(self.even, self.odd))
        if not self.low <= min(self.even, self.odd) <= max(self.even, self.odd) <= self.high:
            raise ValueError(f"Axis(even={self.even}, odd={self.odd}, low={self.low}, high={self.high}): "
                             "needs low <= even, odd <= high")

    @property
    def values(self) -> list[int]:
        return list(range(self.low, self.high + 1, self.step))


@dataclass(frozen=True)
class Space:
    """The shapes one model takes. `masks`: it takes a text mask that reaches attention; `timesteps`: each
    sample may have its own timestep; `batch`: the largest batch explore draws."""
    axes: dict[str, Axis] = field(default_factory=dict)
    masks: bool = False
    timesteps: bool = True
    batch: int = 3


@dataclass(frozen=True)
class Shape:
    """One set of inputs. `lengths` overrides axes by name (others take the base or, with `uneven`, the odd
    value); `padded` is, per sample, how many text positions at the end are masked out (empty: no mask is
    passed at all; `THIRD`: the last third); `shared_timestep`: every sample at the same timestep."""
    batch: int = 1
    lengths: tuple[tuple[str, int], ...] = ()
    uneven: bool = False
    padded: tuple[int, ...] = ()
    shared_timestep: bool = False

    def __post_init__(self):
        object.__setattr__(self, "lengths", tuple(sorted((str(k), int(v)) for k, v in dict(self.lengths).items())))
        object.__setattr__(self, "padded", tuple(int(p) for p in self.padded))
        if self.batch < 1:
            raise ValueError(f"Shape(batch={self.batch}): needs at least one sample")
        if self.padded and len(self.padded) != self.batch:
            raise ValueError(f"Shape(padded={self.padded}): one count per sample ({self.batch})")

    @classmethod
    def of_variant(cls, name: str) -> "Shape":
        return {"base": cls(), "batch2": cls(batch=2), "masked": cls(batch=2, padded=(0, THIRD)),
                "uneven": cls(uneven=True)}[name]

    def length(self, space: Space, axis: str) -> int:
        if axis in dict(self.lengths):
            return dict(self.lengths)[axis]
        spec = space.axes[axis]
        return spec.odd if self.uneven else spec.even

    def masked_count(self, sample: int, length: int) -> int:
        """Text positions masked out at the end of `sample`'s text of `length`; at least one stays."""
        count = self.padded[sample]
        count = -(-length // 3) if count == THIRD else count
        return max(0, min(count, length - 1))

    @property
    def label(self) -> str:
        """The variant name this shape falls under, for known-failure entries and case ids."""
        if self.padded:
            return "masked"
        if self.uneven:
            return "uneven"
        return "batch2" if self.batch > 1 else "base"

    def to_json(self) -> dict:
        return {"batch": self.batch, "lengths": dict(self.lengths), "uneven": self.uneven,
                "padded": list(self.padded), "shared_timestep": self.shared_timestep}

    @classmethod
    def from_json(cls, data: dict) -> "Shape":
        data = dict(data)
        return cls(**dict(data, lengths=tuple(dict(data.get("lengths", {})).items()),
                          padded=tuple(data.get("padded", ()))))

    def describe(self) -> str:
        parts = [f"batch {self.batch}"] + [f"{k} {v}" for k, v in self.lengths]
        if self.padded:
            parts.append(f"padded {list(self.padded)}")
        if self.shared_timestep and self.batch > 1:
            parts.append("one timestep")
        return ", ".join(parts)
