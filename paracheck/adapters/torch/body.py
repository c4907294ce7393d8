"""One torch case on one rank: the spec's module on one device, then its own parallelize on the layout's mesh.

Passes, in the order `domain.adapter` documents: the reference (`build()` under a fixed seed, run on the GLOBAL
batch: no_grad, then training and the backward of the loss), the parallel copy (a deep copy, same weights, given
to the spec's `parallelize(model, mesh, layout)`; a control planted after it; structure checks), its no_grad
forward, its training forward, the forward checks, its backward, the gradient checks. Each data-parallel rank
runs its shard of the batch (dim 0, `dp_index` of `dp_degree` equal shards) and is held to that slice of the
reference's outputs.

The loss is a mean over the batch (the default one is, a spec's own must be): each data-parallel rank's loss is
the mean over its shard, and FSDP averages gradients over the data-parallel ranks, so the averaged gradient is
the gradient of the global mean, which is what the reference differentiates. No factor is applied, unless the
spec says its plan sums gradients (`grad_reduction = "sum"`, torchtitan's), when each rank's loss is divided
by dp x fsdp first. `parity.loss` checks the mean of the local losses against the reference's loss, so a loss
that is not a mean shows there.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
import torch.distributed as dist

from paracheck.adapters.torch import spec as specs
from paracheck.adapters.torch.batches import call as _call, each_tensor, full as _full, shard as _shard, to as _to
from paracheck.adapters.torch import context, grads, localize, names, pipeline, structure
from paracheck.adapters.torch import steps as training
from paracheck.adapters.torch.controls import CONTROLS, PLANTS, planted_in, step_hooks
from paracheck.checks.compare import compare
from paracheck.domain.adapter import Refused
from paracheck.domain.records import CheckId, CheckResult, Route, Status
from paracheck.world import meshes
from paracheck.world.meshes import MeshKey
from paracheck.world.site import local_device

SEED = 0


def default_loss(output, inputs):
    """The first output's squares, weighted along its last dimension (so that a gradient permuted along it, a
    shard from the wrong rank, does not sum to the same value), summed over each sample and averaged over the
    batch: a mean over the batch, as data parallelism needs, with gradients of order one rather than one over
    the element count, so the fp32 tolerance's relative part, not its absolute floor, holds them."""
    out = _leaves(output)[0][1]
    out = _full(out)
    out = out.float()
    ramp = torch.linspace(0.5, 1.5, out.shape[-1], device=out.device, dtype=out.dtype)
    return (out.pow(2) * ramp).sum() / out.shape[0]


@contextmanager
def case_body(ctx):
    yield TorchBody(ctx)


class TorchBody:
    def __init__(self, ctx):
        self.ctx, self.case, self.layout = ctx, ctx.case, ctx.case.layout
        self.rank = dist.get_rank()
        self.atol, self.rtol = ctx.tolerance.atol, ctx.tolerance.rtol
        self.spec = specs.loaded(self.case.factory)
        self.loss_fn = self.spec.loss or default_loss
        self.device = local_device(ctx.backend)
        self.infer = self.train = self.local_loss = None
        self.grads_failed = False
        #: On a layout with pp: the spec's stages and schedule (`pipeline`), and the names any rank's stages hold.
        self.pipe, self.held = None, None

    # -- reference ------------------------------------------------------------------------------------
    def reference(self) -> None:
        layout, case = self.layout, self.case
        reason = specs.refusal(self.spec, layout)
        control = CONTROLS[case.control] if case.control else None
        reason = reason or (control.skip_reason(layout) if control else None)
        if reason:
            raise Refused(reason)
        batch = specs.call_inputs(case.factory, self.spec, layout, case.variant)
        if (problem := specs.split_problem(batch, layout)):
            raise Refused(problem)
        self.batch = _to(batch, self.device)
        self.mine = _shard(self.batch, layout.dp_index(self.rank), layout.dp_degree)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            model = self.spec.build()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"the spec's build() must return an nn.Module, got {type(model).__name__}")
        model = model.to(self.device, torch.float32)
        self.ctx.result.model_class = type(model).__name__
        self.copy = copy.deepcopy(model)  # the same weights, before any gradient exists
        self.twin = copy.deepcopy(model) if case.steps else None  # parity.steps' single-device run
        self.ref_params = {n: p.detach().clone() for n, p in names.parameters(model).items()}
        self.ref_model = model  # localization reruns it on this rank's shard
        with torch.no_grad():
            self.ref_infer = _detached(_call(model, self.batch))
        out = _call(model, self.batch)
        loss = self.loss_fn(out, self.batch)
        loss.backward()
        self.ref_train, self.ref_loss = _detached(out), loss.detach()
        self.ref_grads = {n: (p.grad.detach().clone() if p.grad is not None else None)
                          for n, p in names.parameters(model).items()}

    # -- the parallel model ---------------------------------------------------------------------------
    def parallelize(self) -> None:
        layout = self.layout
        self.ctx.result.route = Route.NATIVE
        self.mesh = meshes.for_world().mesh(MeshKey(self.device.type, layout.mesh_shape, layout.mesh_dims))
        if layout.cp > 1 and self.spec.context_parallel and (why := context.problem(self.mesh, self.device)):
            raise Refused(why)  # decided alike on every rank, before the spec's parallelize
        if layout.pp > 1:
            self.pipe, self.model = pipeline.build(self), None
            self.held = pipeline.elsewhere(self.pipe.parameters())
        else:
            returned = self.spec.parallelize(self.copy, self.mesh, layout)
            self.model = returned if isinstance(returned, torch.nn.Module) else self.copy
        if self.case.control:
            from paracheck.world.regions import as_control_asks

            planted = as_control_asks(CONTROLS[self.case.control].per_rank, PLANTS[self.case.control],
                                      self.pipe or self.model, self.mesh, layout, self.spec)
            self.ctx.result.findings.append(f"{self.case.control} planted in {planted}")
            self.ctx.result.planted_in = planted_in(self.case.control, planted)

    def _params(self) -> dict:
        """The parallel model's parameters by clean name (this rank's stages' on a pipeline)."""
        return self.pipe.parameters() if self.pipe else names.parameters(self.model)

    def structure_checks(self) -> list[CheckResult]:
        params = self._params()
        return [structure.check_mesh(self.mesh, self.layout, params),
                structure.check_shards(params, self.ref_params, self.atol, self.rtol, self.held)]

    def inference(self) -> None:
        if self.pipe:
            self.infer, _ = pipeline.run(self.pipe, self, train=False)
            return
        with torch.no_grad():
            self.infer = _full(_call(self.model, self.mine))

    def training(self) -> None:
        for param in self._params().values():
            param.grad = None
        if self.pipe:  # the schedule's step runs every microbatch's forward and backward
            self.train, self.local_loss = pipeline.run(self.pipe, self, train=True)
            return
        out = _call(self.model, self.mine)
        self.train = _full(out)
        self.local_loss = self.loss_fn(out, self.mine)

    def forward_checks(self) -> list[CheckResult]:
        index, degree = self.layout.dp_index(self.rank), self.layout.dp_degree
        checks = []
        if self.infer is not None:
            checks.append(self._outputs(CheckId.INFERENCE, self.infer, _shard(self.ref_infer, index, degree),
                                        "no_grad output"))
        if self.train is not None:
            checks.append(self._outputs(CheckId.FORWARD, self.train, _shard(self.ref_train, index, degree), "output"))
            checks.append(self._loss())
        return checks

    def backward_skip(self) -> str | None:
        if not self.case.grads:
            return "--no-grads"
        return None if self.local_loss is not None else "the training forward did not run"

    def backward(self) -> None:
        if self.pipe:
            return  # the schedule's step took it
        # A plan that sums over the data-parallel ranks is handed each rank's share of the global mean.
        share = self.layout.dp_degree if self.spec.grad_reduction == "sum" else 1
        (self.local_loss / share).backward()

    def grads_checks(self) -> list[CheckResult]:
        checks = [grads.check(self._params(), self.ref_grads, self.layout, self.atol, self.rtol, self.held)]
        self.grads_failed = checks[0].status == Status.FAIL
        return checks

    def localize(self, checks: list[CheckResult]) -> None:
        if not self.pipe:  # a pipeline's stages are not rerun with hooks; its gradient table is the check's own
            localize.after_checks(self, checks)

    def steps(self) -> list[CheckResult]:
        if self.pipe:
            return [CheckResult(CheckId.STEPS, Status.SKIP, "parity.steps does not drive a pipeline schedule (the "
                                                             "loss and every gradient of one step are checked)")]
        return training.run(self, step_hooks(self.case.control))

    # -- helpers --------------------------------------------------------------------------------------
    def _outputs(self, check_id, actual, expected, what: str) -> CheckResult:
        have, want = _leaves(actual), _leaves(expected)
        if [k for k, _ in have] != [k for k, _ in want]:
            return CheckResult(check_id, Status.FAIL, f"{what}: parts {[k for k, _ in have]} != reference's "
                                                      f"{[k for k, _ in want]}")
        results = [compare(check_id, a, b, self.atol, self.rtol, f"{what}{k}") for (k, a), (_, b) in zip(have, want)]
        failed = next((r for r in results if r.status != Status.PASS), None)
        worst = max(results, key=lambda r: r.max_abs or 0.0)
        out = failed or worst
        out.max_abs = max((r.max_abs or 0.0) for r in results)
        out.max_rel = max((r.max_rel or 0.0) for r in results)
        return out

    def _loss(self) -> CheckResult:
        value = _full(self.local_loss).detach().float().clone()
        dist.all_reduce(value)  # each batch shard's loss is counted once per rank that holds it: world / dp times
        mean = value / self.layout.world
        return compare(CheckId.LOSS, mean, self.ref_loss.float(), self.atol, self.rtol, "loss (mean over dp ranks)")


def _detached(value):
    return each_tensor(value, lambda t: t.detach())


def _leaves(value, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor in an output: `""` for a tensor, `[0]`, `['logits']` inside others."""
    if isinstance(value, torch.Tensor):
        return [(prefix, value)]
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in _leaves(v, f"{prefix}[{k!r}]")]
    if isinstance(value, (tuple, list)):
        return [leaf for i, v in enumerate(value) for leaf in _leaves(v, f"{prefix}[{i}]")]
    if hasattr(value, "items"):  # ModelOutput-like mappings
        return _leaves(dict(value.items()), prefix)
    return []
