"""The diffusers adapter's rank side: one case's passes (`domain.adapter.CaseBody`), from its plan to its checks.

Planning is identical on every rank (`plan`); the single-device reference is computed by the rank that owns its key
(`reference`); then the case's model is copied from the reference's weights, parallelized by its route, and run
as the kit's skeleton (`rank.skeleton`) orders: under `torch.no_grad()` (inference), then with gradients (training
and the backward), every check judging this rank only. The library's scopes for the parallel run (the attention
backend, its warnings, the CPU shims) open at `parallelize` and close when the case ends.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from paracheck.adapters.diffusers import attention, library, localize, reference
from paracheck.adapters.diffusers import checkpoint as saving, steps as training
from paracheck.adapters.diffusers.checks import STRUCTURE, CheckContext, grads_skip_reason, run_checks
from paracheck.adapters.diffusers.controls import CONTROLS, step_hooks
from paracheck.adapters.diffusers.fitting import Unfittable
from paracheck.adapters.diffusers.plan import Sources, plan
from paracheck.adapters.diffusers.routes import apply
from paracheck.adapters.diffusers.weights import copy_of
from paracheck.adapters.diffusers.collectives import count_collectives
from paracheck.domain.adapter import CaseContext, Refused
from paracheck.domain.records import CheckId, Status
from paracheck.world.site import local_device


@dataclass
class _Kept:
    """What a rank keeps between cases: the model sources it loaded, and the reference it read last."""
    sources: Sources = field(default_factory=Sources)
    last_reference: reference.LastReference = field(default_factory=reference.LastReference)


#: This process's sources and last reference: a rank runs one world at a time, so one of each is enough.
_KEPT = _Kept()


def case_body(ctx: CaseContext):
    """The case's body: a pipeline case's (`pipelines.body`), or a single model call's."""
    from paracheck.adapters.diffusers.pipelines.cases import is_pipeline_factory

    if is_pipeline_factory(ctx.case.factory):
        from paracheck.adapters.diffusers.pipelines.body import case_body as pipeline_body

        return pipeline_body(ctx)
    return _model_body(ctx)


@contextlib.contextmanager
def _model_body(ctx: CaseContext):
    body = _Body(ctx)
    try:
        with body.scopes:
            yield body
    except Unfittable as exc:  # a fit only the parallel run could tell (every rank alike): a skip
        raise Refused(str(exc), exc.failure) from exc
    finally:
        ctx.result.findings = body.findings.messages if body.findings else []


class _Body:
    def __init__(self, ctx: CaseContext):
        self.ctx, self.case = ctx, ctx.case
        self.scopes = contextlib.ExitStack()
        self.findings = None
        self.control = CONTROLS[self.case.control] if self.case.control else None
        self.grads_failed = False

    def reference(self) -> None:
        ctx, result = self.ctx, self.ctx.result
        p = self.plan = plan(self.case, ctx.backend, _KEPT.sources)
        result.route, result.fit, result.attention_backend, result.inputs = p.route, p.fit, p.attention, p.traits
        result.model_class = p.model_class.__name__ if p.model_class else None
        device = local_device(ctx.backend)
        if p.key and ctx.site.computes(p.key) and not reference.exists(p, ctx.site.refs_dir):
            reference.compute(p, ctx.site.refs_dir, device)
        if p.stop:  # decided while planning, identically on every rank
            raise Refused(p.stop.reason, p.stop.failure, p.stop.status)
        self.ref = _KEPT.last_reference.get(p, ctx.site.refs_dir, device)

    def parallelize(self) -> None:
        p, ref, ctx = self.plan, self.ref, self.ctx
        fault = self.control.attention_fault if self.control else None
        self.findings = self.scopes.enter_context(library.Findings())
        self.scopes.enter_context(attention.scope(p.attention, fault))
        self.scopes.enter_context(library.parallel_shims(ctx.backend.device_type))
        model = copy_of(p.model_class, p.init_dict, ref.model.state_dict(), ref.out.device, ref.out.dtype)
        model, applied = apply(p.route, model, self.case.layout, ctx.backend, self.control, ref.model,
                               ctx.site.workdir, self.case.cp_options)
        self.model = model
        self.checks = CheckContext(model, ref.model, applied, ref.out, ref.weights, ctx.tolerance.atol,
                                   ctx.tolerance.rtol, grads_requested=self.case.grads, ref_out32=ref.out32,
                                   ref_grads32=ref.grads32, inputs=ref.inputs)

    def structure_checks(self) -> list:
        return run_checks(STRUCTURE, self.checks)

    def inference(self) -> None:
        c = self.checks
        with torch.no_grad(), count_collectives(self.ctx.result.rank, library.observed_attention) as c.inference_collectives:
            c.inference_out, c.inference_error = self.ctx.attempt(
                lambda: reference.forward(self.model, self.ref.inputs), CheckId.INFERENCE)

    def training(self) -> None:
        c = self.checks
        with count_collectives(self.ctx.result.rank, library.observed_attention) as c.collectives:
            c.out, c.forward_error = self.ctx.attempt(lambda: reference.forward(self.model, self.ref.inputs),
                                                      CheckId.FORWARD)

    def forward_checks(self) -> list:
        return run_checks([CheckId.COLLECTIVES, CheckId.FORWARD, CheckId.INFERENCE], self.checks)

    def backward_skip(self) -> str | None:
        return grads_skip_reason(self.checks)

    def backward(self) -> None:
        c = self.checks
        _, c.backward_error = self.ctx.attempt(lambda: (c.out * self.ref.weights).sum().backward(), CheckId.GRADS)

    def grads_checks(self) -> list:
        checks = run_checks([CheckId.GRADS], self.checks)
        self.grads_failed = any(c.status == Status.FAIL for c in checks)
        return checks

    def localize(self, checks: list) -> None:
        localize.after_checks(self.checks, self.ref.inputs, checks, self.ctx.result)

    def steps(self) -> list:
        return training.run(self, step_hooks(self.case.control))

    def checkpoint(self) -> list:
        return saving.run(self)
