"""The batches a transformers case feeds: one global batch per variant or drawn `Shape`, and the share each
data-parallel rank sees.

Labels are the input ids with padded positions set to -100 (ignored by the loss). A data-parallel layout
splits the global batch over its `dp` ranks; every rank passes the global count of predicted tokens as
`num_items_in_batch`, so the ranks' losses add up to the global mean loss, as a trainer computes it.
"""

from __future__ import annotations

import torch

from paracheck.adapters.transformers.fixtures import SPACE, TOKENS
from paracheck.domain.shapes import Shape

LENGTH = SPACE.axes[TOKENS].even
PAD = 4  # padded tokens of sample 1 in the padded variants
PACKED = (5, 7)  # two documents per packed row
PAD_ID = 0


def variant_shape(variant: str, dp: int) -> Shape:
    """A named variant's rows: `max(2, dp)` rounded up to a multiple of `dp` (batch 2 without data parallelism)
    of `LENGTH` tokens; every second row padded with `PAD` tokens, or every row two documents."""
    rows = -(-max(2, dp) // dp) * dp
    if variant in ("left_pad", "right_pad"):
        return Shape(rows, padded=[PAD * (r % 2) for r in range(rows)], pad_side=variant.split("_")[0],
                     token_rows=True)
    if variant == "packed":
        return Shape(rows, documents=[PACKED] * rows, token_rows=True)
    if variant not in ("base", "embeds"):
        raise ValueError(f"variant {variant!r}: transformers variants are base, left_pad, right_pad, packed, embeds")
    return Shape(rows, token_rows=True)


def global_batch(variant: str, dp: int, vocab: int, seed: int = 1) -> dict:
    """The named variant's global batch."""
    return from_shape(variant_shape(variant, dp), vocab, seed)


def from_shape(shape: Shape, vocab: int, seed: int = 1) -> dict:
    """Random token rows of `shape`: `attention_mask` (0 on each row's padding, on its side) where the shape
    pads, `position_ids` restarting at each packed document, labels -100 where padded."""
    length = shape.length(SPACE, TOKENS)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (shape.batch, length), generator=generator)
    mask = torch.ones(shape.batch, length, dtype=torch.long)
    batch = {"input_ids": ids}
    if shape.padded:
        for row in range(shape.batch):
            count = shape.masked_count(row, length)
            padded = slice(None, count) if shape.pad_side == "left" else slice(length - count, None)
            mask[row, padded] = 0
            ids[row, padded] = PAD_ID
        batch["attention_mask"] = mask
    if shape.documents:
        batch["position_ids"] = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in shape.documents])
    batch["labels"] = ids.masked_fill(mask == 0, -100)
    return batch


def predicted_tokens(labels: torch.Tensor) -> int:
    """The tokens the causal loss predicts: labels shifted by one, padding (-100) left out."""
    return int((labels[:, 1:] != -100).sum())


def rows_in(batch: dict) -> int:
    """How many rows `batch` holds: its input_ids' dim 0 (else its first tensor's)."""
    return (batch["input_ids"] if "input_ids" in batch else next(iter(batch.values()))).shape[0]


def rows(batch: dict, start: int, stop: int) -> dict:
    """Rows `start` to `stop` of `batch`: the one rule for cutting a batch by rows (a data-parallel share, the
    Trainer's items). Every tensor's dim 0 is the batch's rows times an equal block per row: 1 for a tensor of one
    entry per row, more for one packing every row's image patches in one sequence (each image the same size), which
    gives those rows' blocks."""
    count = rows_in(batch)

    def cut(name, tensor):
        block = tensor.shape[0] // count
        if block == 0 or tensor.shape[0] % count:  # a rank would get another row's entries, or none, silently
            raise ValueError(f"cannot share {name!r} by rows: its dim 0 ({tensor.shape[0]}) is no whole multiple of "
                             f"the batch's {count} rows")
        return tensor[start * block:stop * block]

    return {k: cut(k, v) for k, v in batch.items()}


def share(batch: dict, index: int, dp: int) -> dict:
    """Data-parallel rank `index`'s rows of `batch` (contiguous, in rank order), cut by `rows`."""
    per = rows_in(batch) // dp
    return rows(batch, index * per, (index + 1) * per)


def joined(parts: list[dict]) -> dict:
    """`parts` (batches cut by `rows`) end to end as one batch: each tensor's dim 0 concatenated, so a packed
    tensor's blocks follow their rows again."""
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


#: The text token random ids fall back to where they drew a placeholder's (or a bound token's) id.
TEXT_ID = 1


def placed(batch: dict, token: int, count: int, what: str, before: int | None = None,
           after: int | None = None) -> tuple:
    """(`batch`'s input_ids with `count` placeholders `token` from each row's first unmasked position, after the
    `before` token and followed by the `after` token where given, at least one text token left after them; the
    placeholders' mask). Random ids that drew a special id become `TEXT_ID`. A row too short raises ValueError naming
    `what` (an image, a clip) and what it takes."""
    ids = batch["input_ids"].clone()
    for special in (token, before, after):
        if special is not None:
            ids[ids == special] = TEXT_ID
    mask = batch.get("attention_mask", torch.ones_like(ids))
    where = torch.zeros_like(ids, dtype=torch.bool)
    bounds = (before is not None) + (after is not None)
    for row in range(ids.shape[0]):
        real = mask[row].nonzero().flatten()
        if len(real) < count + bounds + 1:
            raise ValueError(f"row {row} has {len(real)} tokens: {what} takes {count} placeholders"
                             + (f" and {bounds} tokens around them" if bounds else "") + ", and one text token follows")
        start = int(real[0]) + (before is not None)
        where[row, start:start + count] = True
        if before is not None:
            ids[row, start - 1] = before
        if after is not None:
            ids[row, start + count] = after
    ids[where] = token
    return ids, where


def without_labels(batch: dict) -> dict:
    """`batch` as the model's forward takes it for logits alone (no loss)."""
    return {k: v for k, v in batch.items() if k != "labels"}


def with_embeds(batch: dict, embed) -> dict:
    """`input_ids` replaced by `embed(input_ids)` (the single-process model's embedding, detached)."""
    out = dict(batch)
    with torch.no_grad():
        out["inputs_embeds"] = embed(out.pop("input_ids")).detach()
    return out
