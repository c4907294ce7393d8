"""The batches a transformers case feeds: one global batch per variant, and the share each data-parallel rank sees.

Labels are the input ids with padded positions set to -100 (ignored by the loss). A data-parallel layout
splits the global batch over its `dp` ranks; every rank passes the global count of predicted tokens as
`num_items_in_batch`, so the ranks' losses add up to the global mean loss, as a trainer computes it.
"""

from __future__ import annotations

import torch

LENGTH = 12
PAD = 4  # padded tokens of sample 1 in the padded variants
PACKED = (5, 7)  # two documents per packed row
PAD_ID = 0


def global_batch(variant: str, dp: int, vocab: int, seed: int = 1) -> dict:
    """The global batch: `max(2, dp)` rows rounded up to a multiple of `dp` (batch 2 without data parallelism)."""
    rows = -(-max(2, dp) // dp) * dp
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (rows, LENGTH), generator=generator)
    mask = torch.ones(rows, LENGTH, dtype=torch.long)
    batch = {"input_ids": ids}
    if variant in ("left_pad", "right_pad"):
        padded = slice(None, PAD) if variant == "left_pad" else slice(LENGTH - PAD, None)
        mask[1::2, padded] = 0
        ids[1::2, padded] = PAD_ID
        batch["attention_mask"] = mask
    elif variant == "packed":
        batch["position_ids"] = torch.cat([torch.arange(n) for n in PACKED]).expand(rows, -1).clone()
    elif variant not in ("base", "embeds"):
        raise ValueError(f"variant {variant!r}: transformers variants are base, left_pad, right_pad, packed, embeds")
    labels = ids.masked_fill(mask == 0, -100)
    batch["labels"] = labels
    return batch


def predicted_tokens(labels: torch.Tensor) -> int:
    """The tokens the causal loss predicts: labels shifted by one, padding (-100) left out."""
    return int((labels[:, 1:] != -100).sum())


def share(batch: dict, index: int, dp: int) -> dict:
    """Data-parallel rank `index`'s rows of `batch` (contiguous, in rank order)."""
    rows = next(iter(batch.values())).shape[0]
    per = rows // dp
    return {k: v[index * per:(index + 1) * per] for k, v in batch.items()}


def with_embeds(batch: dict, embed) -> dict:
    """`input_ids` replaced by `embed(input_ids)` (the single-process model's embedding, detached)."""
    out = dict(batch)
    with torch.no_grad():
        out["inputs_embeds"] = embed(out.pop("input_ids")).detach()
    return out
