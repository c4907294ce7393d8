"""Whether a model's rows depend on the rest of its batch on one process: the typed origin of a data-parallel
failure that no parallel code causes.

A data-parallel check holds a rank's rows against the same rows of the single-process run of the whole batch. That
is only right where a row's output depends on that row alone. Where the model itself couples rows (an index counted
over the batch, a statistic taken across it), a share run alone differs from its rows of the whole batch on one
process too, and every data-parallel check fails for a reason the layout did not add. The kit measures that on the
single-process model where such a check fails, and types the failure by it (`ROWS_COUPLED`), so a known-failures
entry declares the measured cause instead of a layout glob.
"""

from __future__ import annotations

import torch

from paracheck.checks.compare import compare
from paracheck.domain.records import CheckId, Status
from paracheck.adapters.transformers import inputs

#: The site of a data-parallel check's failure where the single-process model's rows depend on the batch.
ROWS_COUPLED = "reference:rows_depend_on_batch"


def alone(ref, batch: dict, index: int, dp: int) -> torch.Tensor:
    """The single-process no_grad logits of data-parallel share `index` of `dp` run alone."""
    with torch.no_grad():
        return ref(**inputs.without_labels(inputs.share(batch, index, dp)), use_cache=False).logits


def batch_apart(shares, whole_logits: torch.Tensor, dp: int, atol: float, rtol: float) -> tuple[int, float] | None:
    """(the first data-parallel share, of `dp`, whose logits run alone (`shares(index)`, `alone`'s) lie beyond the
    case's bound of that share's rows of `whole_logits` (the whole batch's), and the largest difference there);
    None where every share agrees."""
    for index in range(dp):
        held = compare(CheckId.FORWARD, shares(index), inputs.share({"x": whole_logits}, index, dp)["x"], atol, rtol)
        if held.status == Status.FAIL:
            return index, held.max_abs
    return None


def said(index: int, apart: float) -> str:
    """The words a check's detail gains where `batch_apart` measured a coupling."""
    return (f"; on one process data-parallel share {index}'s rows run alone differ from the whole batch's by "
            f"{apart:.3g}: the model's rows depend on the rest of the batch ({ROWS_COUPLED})")
