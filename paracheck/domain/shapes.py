"""Input shapes: what a fixture builds (batch, lengths, masks, timesteps, padding side, packing), and the space
`explore` draws from.

A `Shape` is the input side of a case, independent of model and layout: the named variants (diffusers'
`base`, `batch2`, `masked`, `uneven`; transformers' `base`, `left_pad`, `right_pad`, `packed`) are
particular shapes, and `paracheck explore` draws others. A `Space` says which shapes a model takes: its
length axes with their base and uneven lengths and the range explore may draw, whether it takes a mask, how
many samples, and whether its inputs are token rows. Torch-free and JSON-able, so a shape travels inside a
case and into a found case's replay file.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: `Shape.padded` value of the named `masked` variant: sample 0 unmasked, the last third of sample 1's text.
THIRD = -3
#: Where a row's padding sits: the end (a diffusers text mask always masks there) or, for token rows, the start.
PAD_SIDES = ("right", "left")
#: The one length axis of token rows: tokens per row (padding and packed documents count in it).
TOKENS = "tokens"


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
    """The shapes one model takes. `masks`: it takes a mask that reaches attention; `timesteps`: each
    sample may have its own timestep; `batch`: the largest batch explore draws; `token_rows`: its inputs are
    rows of tokens (a causal LM's), which may be padded on either side or packed with several documents."""
    axes: dict[str, Axis] = field(default_factory=dict)
    masks: bool = False
    timesteps: bool = True
    batch: int = 3
    token_rows: bool = False

    def __post_init__(self):
        if self.token_rows and set(self.axes) != {TOKENS}:
            raise ValueError(f"Space(axes={sorted(self.axes)}, token_rows=True): token rows have one axis, {TOKENS!r}")


@dataclass(frozen=True)
class Shape:
    """One set of inputs. `lengths` overrides axes by name (others take the base or, with `uneven`, the odd
    value); `padded` is, per sample, how many positions are masked out (empty: no mask is passed at all;
    `THIRD`: the last third), at the end of the text or, for `token_rows`, on `pad_side`; `documents` is, per
    row of tokens, the lengths of the documents packed into it (`position_ids` restart at each);
    `shared_timestep`: every sample at the same timestep; `token_rows`: the inputs are rows of tokens, whose
    variants are named by their padding and packing (any batch is `base`)."""
    batch: int = 1
    lengths: tuple[tuple[str, int], ...] = ()
    uneven: bool = False
    padded: tuple[int, ...] = ()
    shared_timestep: bool = False
    pad_side: str = "right"
    documents: tuple[tuple[int, ...], ...] = ()
    token_rows: bool = False

    def __post_init__(self):
        object.__setattr__(self, "lengths", tuple(sorted((str(k), int(v)) for k, v in dict(self.lengths).items())))
        object.__setattr__(self, "padded", tuple(int(p) for p in self.padded))
        object.__setattr__(self, "documents", tuple(tuple(int(n) for n in row) for row in self.documents))
        if self.batch < 1:
            raise ValueError(f"Shape(batch={self.batch}): needs at least one sample")
        if self.padded and len(self.padded) != self.batch:
            raise ValueError(f"Shape(padded={self.padded}): one count per sample ({self.batch})")
        self._check_token_fields()
        if not any(p != 0 for p in self.padded):  # nothing padded: the side changes no input, so one name for it
            object.__setattr__(self, "pad_side", "right")

    def _check_token_fields(self) -> None:
        if self.token_rows and (self.uneven or self.shared_timestep or set(dict(self.lengths)) - {TOKENS}):
            raise ValueError(f"Shape(token_rows=True, lengths={dict(self.lengths)}, uneven={self.uneven}, "
                             f"shared_timestep={self.shared_timestep}): token rows have one length, {TOKENS!r}, "
                             "and no uneven or timestep fields")
        if self.pad_side not in PAD_SIDES:
            raise ValueError(f"Shape(pad_side={self.pad_side!r}): must be one of {', '.join(PAD_SIDES)}")
        if self.pad_side == "left" and any(self.padded) and not self.token_rows:
            raise ValueError("Shape(pad_side='left'): only token rows are padded at the start "
                             "(a text mask masks the end)")
        if not self.documents:
            return
        if not self.token_rows:
            raise ValueError(f"Shape(documents={self.documents}): only token rows are packed")
        if len(self.documents) != self.batch or any(not row or min(row) < 1 for row in self.documents):
            raise ValueError(f"Shape(documents={self.documents}): one row of document lengths >= 1 per sample "
                             f"({self.batch})")
        if self.padded:
            raise ValueError(f"Shape(documents=..., padded={self.padded}): a packed row carries no padding")

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
        """Positions masked out of `sample`'s text (or row) of `length`; at least one stays."""
        count = self.padded[sample]
        count = -(-length // 3) if count == THIRD else count
        return max(0, min(count, length - 1))

    @property
    def label(self) -> str:
        """The variant name this shape falls under, for known-failure entries and case ids: token rows are
        `packed`, `left_pad` or `right_pad` (a mask is passed) or `base`, as `run`'s transformers variants;
        other inputs `masked`, `uneven`, `batch2` or `base`, as the diffusers variants."""
        if self.token_rows:
            return "packed" if self.documents else f"{self.pad_side}_pad" if self.padded else "base"
        if self.padded:
            return "masked"
        if self.uneven:
            return "uneven"
        return "batch2" if self.batch > 1 else "base"

    def to_json(self) -> dict:
        """The fields; the token-row ones only where set, so every other shape's JSON (and a case's key) is
        what it was before they existed."""
        data = {"batch": self.batch, "lengths": dict(self.lengths), "uneven": self.uneven,
                "padded": list(self.padded), "shared_timestep": self.shared_timestep}
        if self.token_rows:
            data["token_rows"] = True
        if self.pad_side != "right":
            data["pad_side"] = self.pad_side
        if self.documents:
            data["documents"] = [list(row) for row in self.documents]
        return data

    @classmethod
    def from_json(cls, data: dict) -> "Shape":
        data = dict(data)
        return cls(**dict(data, lengths=tuple(dict(data.get("lengths", {})).items()),
                          padded=tuple(data.get("padded", ())),
                          documents=tuple(tuple(row) for row in data.get("documents", ()))))

    def describe(self) -> str:
        parts = [f"batch {self.batch}"] + [f"{k} {v}" for k, v in self.lengths]
        if self.padded:
            parts.append(f"padded {list(self.padded)}" + (f" on the {self.pad_side}" if self.token_rows else ""))
        if self.documents:
            parts.append(f"packed {[list(row) for row in self.documents]}")
        if self.shared_timestep and self.batch > 1:
            parts.append("one timestep")
        return ", ".join(parts)
