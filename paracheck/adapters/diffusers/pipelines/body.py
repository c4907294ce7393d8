"""A pipeline case's passes on one rank (`domain.adapter.CaseBody`): plan -> reference -> the parallel pipeline (its
transformer through the case's route, its cache) -> the structure checks on that transformer -> the denoising loop,
recorded step by step -> `parity.pipeline` -> where it failed on any rank, the localization.

A pipeline runs no backward: the training, backward and gradient passes are empty, and the skeleton is told so.
"""

from __future__ import annotations

import contextlib
import copy

import torch

from paracheck.adapters.diffusers import attention, library
from paracheck.adapters.diffusers.checks import STRUCTURE, CheckContext, cp_process_group, run_checks
from paracheck.adapters.diffusers.fitting import Unfittable
from paracheck.adapters.diffusers.pipelines import agree, caches, check, reference
from paracheck.adapters.diffusers.pipelines.controls import PIPELINE_CONTROLS, plant_cache
from paracheck.adapters.diffusers.pipelines.plan import Sources, plan
from paracheck.adapters.diffusers.reference import torch_dtype
from paracheck.adapters.diffusers.routes import apply
from paracheck.domain.adapter import CaseContext, Refused
from paracheck.domain.records import CheckId, Route
from paracheck.world.site import local_device

#: This process's pipeline sources and the pipeline reference it read last.
_SOURCES = Sources()
_LAST = reference.LastPipelineReference()


@contextlib.contextmanager
def case_body(ctx: CaseContext):
    body = PipelineBody(ctx)
    try:
        with body.scopes:
            yield body
    except (Unfittable, caches.Refused) as exc:
        raise Refused(str(exc), getattr(exc, "failure", None)) from exc
    finally:
        ctx.result.findings = body.findings.messages if body.findings else []


class PipelineBody:
    def __init__(self, ctx: CaseContext):
        self.ctx, self.case = ctx, ctx.case
        self.scopes = contextlib.ExitStack()
        self.findings = None
        self.control = PIPELINE_CONTROLS[self.case.control] if self.case.control else None
        self.device = local_device(ctx.backend)
        self.dtype = torch_dtype(self.case.dtype)
        self.recording, self.raised = None, None
        self.guarded = False  # the first-block cache's decisions gathered across CP ranks (`agree.guard`)

    def reference(self) -> None:
        ctx, result = self.ctx, self.ctx.result
        p = self.plan = plan(self.case, ctx.backend, _SOURCES)
        result.route, result.fit, result.attention_backend, result.inputs = p.route, p.fit, p.attention, p.traits
        result.model_class = p.transformer_class.__name__ if p.transformer_class else None
        if p.key and ctx.site.computes(p.key) and not reference.exists(p, ctx.site.refs_dir):
            reference.compute(p, ctx.site.refs_dir, self.device)
        if p.stop:
            raise Refused(p.stop.reason, p.stop.failure, p.stop.status)
        self.ref = _LAST.get(p, ctx.site.refs_dir, self.device)

    def parallelize(self) -> None:
        p, ref, ctx = self.plan, self.ref, self.ctx
        self.findings = self.scopes.enter_context(library.Findings())
        self.scopes.enter_context(attention.scope(p.attention))
        self.scopes.enter_context(library.parallel_shims(ctx.backend.device_type))
        components = ref.components(p, self.device, self.dtype)
        model, applied = apply(p.route, components["transformer"], self.case.layout, ctx.backend, self.control,
                               ref.transformer, ctx.site.workdir, self.case.cp_options)
        # A load builds the transformer afresh, on the CPU in fp32: placed as the reference's.
        components["transformer"] = model.to(self.device, self.dtype) if p.route == Route.SHARDED_LOAD else model
        self.pipe = p.pipeline(components)
        if p.cache:
            caches.enable(self.pipe, p.cache, p.steps, p.source.guidance, p.source.caches.get(p.cache, {}))
            if p.cache == "first-block-cache":
                self.guarded = agree.guard(self.pipe, cp_process_group(applied))
            ctx.result.planted_in = plant_cache(self.pipe, applied, self.case.control)
        empty = torch.empty(0)
        self.checks = CheckContext(model, ref.transformer, applied, empty, empty, ctx.tolerance.atol,
                                   ctx.tolerance.rtol, grads_requested=False)

    def structure_checks(self) -> list:
        return run_checks(STRUCTURE, self.checks)

    def inference(self) -> None:
        self.recording, self.raised = self.ctx.attempt(
            lambda: reference.run(self.plan, self.pipe, self.device, self.dtype, record_calls=True), CheckId.PIPELINE)

    def training(self) -> None:
        """A pipeline trains nothing."""

    def forward_checks(self) -> list:
        tol = self.ctx.tolerance
        result = check.check(self.ref, self.recording, tol.atol, tol.rtol, self.raised)
        if self.guarded:
            result.data["stood_in"] = copy.deepcopy(agree.REPORTED)  # each case's own: data is edited per case
        return [result]

    def backward_skip(self) -> str | None:
        return "a pipeline case runs no backward"

    def backward(self) -> None:
        """Never called (`backward_skip`)."""

    def grads_checks(self) -> list:
        return []

    def steps(self) -> list:
        """A pipeline takes no optimizer step: nothing to report where the run asks for `parity.steps`."""
        return []

    def checkpoint(self) -> list:
        """Nor a save (the transformer's own cases take `checkpoint.roundtrip`)."""
        return []

    def localize(self, checks: list) -> None:
        from paracheck.adapters.diffusers.pipelines import localize

        localize.after_checks(self, checks)
