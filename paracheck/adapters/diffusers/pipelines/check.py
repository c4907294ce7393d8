"""`parity.pipeline` on one rank: the parallel pipeline's latents after every step, its final latents and its decoded
output, each held to the single-device pipeline's by the kit's rule (`checks.compare`: fp32 elementwise at the
case's tolerance, reduced precision against the single-device run's own error).

The check's data carries the error-growth curve (`steps`: per step the largest |difference|, the bound it is held to
at its largest reference value, and how far over the elementwise bound its worst element is, > 1 beyond), the first
step beyond tolerance, and, lifted to the case (`records.TO_CASE`), the curve and the three pictures.
"""

from __future__ import annotations

import torch

from paracheck.adapters.diffusers.pipelines import images, loop
from paracheck.checks.compare import compare
from paracheck.domain.records import TO_CASE, CheckId, CheckResult, Status


def step_point(result: CheckResult, actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> dict:
    """One point of the curve: max_abs, the bound at the largest reference value, and the worst element's ratio to
    its own bound (the reduced-precision rule has one bound for the whole tensor)."""
    data = result.data or {}
    if "bound" in data:
        return {"max_abs": result.max_abs, "bound": data["bound"], "over": data.get("ratio")}
    a, b = actual.detach().double().cpu(), expected.detach().double().cpu()
    over = float(((a - b).abs() / (atol + rtol * b.abs())).max()) if a.shape == b.shape and a.numel() else None
    return {"max_abs": result.max_abs, "bound": atol + rtol * float(b.abs().max()), "over": over}


def check(ref, rec: loop.Recording | None, atol: float, rtol: float, raised=None) -> CheckResult:
    """This rank's pipeline against the reference (`ref`: a `reference.PipelineReference`)."""
    if raised is not None:
        return CheckResult(CheckId.PIPELINE, Status.FAIL, f"the parallel pipeline raised {raised}",
                           failure=raised.failure)
    if len(rec.steps) != len(ref.steps):
        return CheckResult(CheckId.PIPELINE, Status.FAIL, f"the parallel pipeline took {len(rec.steps)} steps, the "
                           f"single-device one {len(ref.steps)}")
    curve, first = [], None
    for i, (got, want) in enumerate(zip(rec.steps, ref.steps)):
        want32 = ref.steps32[i] if ref.steps32 else None
        result = compare(CheckId.PIPELINE, got, want, atol, rtol, what=f"latents after step {i + 1}", expected32=want32)
        curve.append(step_point(result, got, want, atol, rtol))
        if result.status == Status.FAIL and first is None:
            first = (i, result)
    image = compare(CheckId.PIPELINE, rec.output, ref.output, atol, rtol, what="decoded output",
                    expected32=ref.output32)
    worst = max((p["max_abs"] for p in curve if p["max_abs"] is not None), default=None)
    data = {"steps": curve, "first_step": None if first is None else first[0] + 1,
            "output": {"max_abs": image.max_abs, "max_rel": image.max_rel}}
    data[TO_CASE] = {"steps": curve, "images": images.shown(loop.first_image(ref.output), loop.first_image(rec.output))}
    problems = []
    if first is not None:
        i, result = first
        problems.append(f"latents beyond tolerance from step {i + 1} of {len(curve)} (max_abs {result.max_abs:.2e} "
                        f"there, {curve[-1]['max_abs']:.2e} after the last)")
    if image.status == Status.FAIL:
        problems.append(f"decoded output beyond tolerance (max_abs {image.max_abs:.2e})" if image.max_abs is not None
                        else image.detail)
    status = Status.FAIL if problems else Status.PASS
    detail = "; ".join(problems) or (f"{len(curve)} steps within tolerance, the largest difference {worst:.2e}; "
                                     f"decoded output {image.max_abs:.2e}")
    return CheckResult(CheckId.PIPELINE, status, detail, worst, image.max_rel, atol, rtol, data=data)
