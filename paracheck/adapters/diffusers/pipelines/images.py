"""What the report shows of a pipeline case's output: the reference picture, the parallel one and their difference,
as PNG in base64 (the HTML report inlines them; nothing is fetched).

The difference is |parallel - reference| per pixel, the largest channel's, stretched so its largest value is white:
`scale` says by how much (1 / that value), and `max_abs` what it was; an exact match is black with scale 0.
"""

from __future__ import annotations

import base64
import io

import torch


def png(picture: torch.Tensor) -> str:
    """A (channels, height, width) picture in [0, 1] as base64 PNG (one channel: grey; more: the first three)."""
    from PIL import Image

    data = (picture.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8)
    data = data[:3] if data.shape[0] >= 3 else data[:1]
    array = data.permute(1, 2, 0).numpy()
    image = Image.fromarray(array[..., 0] if array.shape[-1] == 1 else array, "L" if array.shape[-1] == 1 else "RGB")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def shown(reference: torch.Tensor, parallel: torch.Tensor) -> dict:
    """The three pictures for the report: reference, parallel, difference (stretched), with the figures."""
    reference, parallel = reference.detach().float().cpu(), parallel.detach().float().cpu()
    diff = (parallel - reference).abs().amax(0, keepdim=True) if parallel.shape == reference.shape else None
    out = {"reference": png(reference), "parallel": png(parallel), "height": int(reference.shape[-2]),
           "width": int(reference.shape[-1])}
    if diff is not None:
        worst = float(diff.max())
        out.update(difference=png(diff / worst if worst > 0 else diff), max_abs=worst,
                   scale=(1.0 / worst) if worst > 0 else 0.0)
    return out
