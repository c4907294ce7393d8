"""The transformers adapter's rank side: one case's passes (`domain.adapter.CaseBody`): the checkpoint loaded with
and without `distributed_config`, both run, then checked.

The world is already up; transformers is handed this world's meshes (`library.world_meshes`), so a world running
many cases builds each shape's mesh once. Every rank computes its own single-process reference from the same
checkpoint (the fixtures are tiny), so no reference crosses ranks, and keeps its last few for the cases that share
them (`_REFERENCES`). On the parallel model: structure, the inference forward (no_grad; the rowwise local path only
runs there), gradients cleared the optimizer's way, the training forward and backward, then loss, logits and every
gradient (DTensors gathered).
"""

from __future__ import annotations

import contextlib
import json
import math
import os

import torch
import torch.distributed as dist

from paracheck.checks.compare import compare
from paracheck.checks.shards import full
from paracheck.checks.traits import input_traits
from paracheck.domain.adapter import CaseContext, Refused
from paracheck.domain.records import CheckId, CheckResult, Failure, FailureKind, Route, Status
from paracheck.adapters.transformers import cases, coupling, fixtures, inputs, library, localize, structure, tasks
from paracheck.adapters.transformers.layout import config_kwargs
from paracheck.adapters.transformers.controls import CONTROLS, NO_PLANT, PLANTS
from paracheck.world import meshes
from paracheck.world.localworld import per_rank_tensors
from paracheck.world.recent import Recent

#: This process's single-process references, by what they depend on: the factory and checkpoint, the variant,
#: the drawn shape and the data-parallel degree (the rows of the global batch). A world runs a fixture's layouts
#: one after another, so neighbouring cases often share one. Nothing in a case writes to one (controls plant
#: into the parallel model only); a few tiny models, so memory stays flat.
_REFERENCES = Recent(3, "transformers reference")


@contextlib.contextmanager
def case_body(ctx: CaseContext):
    ctx.result.route = Route.SHARDED_LOAD
    yield _Body(ctx)


def checkpoint(case, fixture: str, folder: str) -> str:
    """The case's checkpoint: the folder a pytest mixin wrote (`case.payload`), else the bundled `fixture`'s,
    which rank 0 writes into `folder` (once per run) while every rank waits for it."""
    if case.payload:
        return case.payload
    if dist.get_rank() == 0:
        fixtures.save(fixture, folder)
    dist.barrier()
    return os.path.join(folder, f"transformers-{fixture}")


class _Body:
    def __init__(self, ctx: CaseContext):
        self.ctx, self.case, self.layout = ctx, ctx.case, ctx.case.layout
        self.control = CONTROLS[self.case.control] if self.case.control else None
        self.plant = PLANTS[self.case.control] if self.case.control else NO_PLANT
        self.tol = ctx.tolerance

    def reference(self) -> None:
        case, layout, result = self.case, self.layout, self.ctx.result
        if self.control and (reason := self.control.skip_reason(layout)):
            raise Refused(reason)
        # The factory runs here too, as a diffusers spec's does on its ranks (a spec may bend this process).
        fixture, shape = (case.model, case.shape) if case.payload else cases.spec_inputs(case.factory, case.variant,
                                                                                         case.shape)
        result.raised_in_parallel = True  # the checkpoint's barrier is a collective
        self.path = checkpoint(case, fixture, os.path.dirname(os.path.abspath(self.ctx.site.workdir)))
        result.raised_in_parallel = False
        # The factory is part of the key: a spec may bend the single-process model too.
        key = (case.factory, self.path, case.variant, json.dumps(shape.to_json(), sort_keys=True) if shape else None,
               layout.dp)
        ref, self.batch, self.expected = _REFERENCES.get(key, lambda: _single_process(self.path, case, shape, layout,
                                                                                      result))
        self.ref, self.task = ref, tasks.of_case(case.model, ref)
        result.model_class = type(ref).__name__
        result.inputs = input_traits(self.batch)
        missing = [k for k in self.plant.needs_rules if k not in ref.tp_plan]
        if missing:
            raise Refused(f"{case.control}: {result.model_class}'s tp_plan has no rule for {', '.join(missing)}")
        if self.plant.needs_model and (why := self.plant.needs_model(ref)):
            raise Refused(f"{case.control}: {result.model_class}: {why}")
        if self.plant.needs_inputs and (why := self.plant.needs_inputs(ref, self.batch)):
            raise Refused(f"{case.control}: {result.model_class}: {why}")
        self.plant = self.plant.bound(ref)

    def parallelize(self) -> None:
        self.model = _load_parallel(self.path, self.layout, self.plant, self.ctx.backend)
        if self.plant.after_load:
            planted = after_load(self.control, self.plant, self.model, self.layout)
            self.ctx.result.planted_in = planted if isinstance(planted, str) else None

    def structure_checks(self) -> list:
        return [structure.check_mesh(self.model, self.layout, dist.get_rank()),
                structure.check_placements(self.model, self.ref, self.layout)]

    def inference(self) -> None:
        layout = self.layout
        # in a local world every rank's data shard at once
        self.mine = per_rank_tensors(lambda rank: inputs.share(self.batch, layout.dp_index(rank), layout.dp))
        with torch.no_grad():
            self.infer = full(self.model(**inputs.without_labels(self.mine), use_cache=False).logits)

    def training(self) -> None:
        # The optimizer's way (set_to_none), not model.zero_grad(): FSDP2 groups kept unsharded after a no_grad
        # forward make model.zero_grad() miss the sharded gradients.
        torch.optim.SGD(self.model.parameters(), lr=0.0).zero_grad(set_to_none=True)
        self.out = self.model(**self.mine, **tasks.loss_kwargs(self.task, self.batch["labels"]), use_cache=False)

    def forward_checks(self) -> list:
        layout, expected, tol = self.layout, self.expected, self.tol
        dp_index = layout.dp_index(dist.get_rank())  # asked here: a local world checks once per rank, as each
        ref_infer = inputs.share({"x": expected["infer"]}, dp_index, layout.dp)["x"]
        ref_logits = inputs.share({"x": expected["logits"]}, dp_index, layout.dp)["x"]
        checks = [_logits(CheckId.INFERENCE, self.infer, ref_infer, layout, tol, "no_grad logits"),
                  _logits(CheckId.FORWARD, full(self.out.logits), ref_logits, layout, tol, "logits")]
        if self.out.loss is None:
            # A failure, declared in known_failures.toml for pipeline layouts: labels were given, no loss came back.
            return checks + [CheckResult(CheckId.LOSS, Status.FAIL,
                                         f"labels given, but the forward returned no loss (pp_size={layout.pp})")]
        total = self.out.loss.detach().clone()
        dist.all_reduce(total)  # each data shard's loss counted once per rank holding it: world / dp times
        shards = layout.world // layout.dp * (layout.dp if tasks.shard_mean(self.task, self.ref) else 1)
        checks.append(compare(CheckId.LOSS, total / shards, expected["loss"], tol.atol, tol.rtol, "loss"))
        parallel = {CheckId.INFERENCE: self.infer, CheckId.FORWARD: full(self.out.logits)}
        return self._typed(checks, lambda check: check.id not in parallel or compare(
            check.id, parallel[check.id], self._alone(dp_index), tol.atol, tol.rtol).status == Status.PASS)

    def _typed(self, checks: list, alone_agrees=lambda check: True) -> list:
        """`checks`, each failing comparison of finite values (no raise, no site typed yet) typed
        `coupling.ROWS_COUPLED` where the single-process model's rows depend on the batch and `alone_agrees(check)`:
        the logits checks only where the parallel logits are this share's run alone on one process, so a bug of the
        layout on such a model stays untyped. Measured once a case, at the first such failure (a passing case pays
        nothing); not for a control (its plain case says whether the model couples). Any share's coupling types a
        reduced check's failure (gradients, steps): they sum over the shares."""
        open_ = [c for c in checks if c.status == Status.FAIL and c.max_abs is not None and math.isfinite(c.max_abs)
                 and (c.failure is None or (c.failure.kind == FailureKind.CHECK and not c.failure.site))]
        if self.layout.dp == 1 or self.control is not None or not open_:
            return checks
        if "_apart" not in self.__dict__:  # one body for every rank of a local world: the figure is the batch's
            self._apart = coupling.batch_apart(self._alone, self.expected["infer"], self.layout.dp, self.tol.atol,
                                               self.tol.rtol)
        for check in open_ if self._apart is not None else []:
            if alone_agrees(check):
                check.failure = Failure(FailureKind.CHECK, check.id, site=coupling.ROWS_COUPLED)
                check.detail += coupling.said(*self._apart)
        return checks

    def _alone(self, index: int):
        """Data-parallel share `index`'s single-process logits run alone (`coupling.alone`), kept for the case."""
        kept = self.__dict__.setdefault("_alone_logits", {})
        if index not in kept:
            kept[index] = coupling.alone(self.ref, self.batch, index, self.layout.dp)
        return kept[index]

    def backward_skip(self) -> str | None:
        if self.out.loss is None:
            return "no loss to take gradients of"
        return None if self.case.grads else "--no-grads"

    def backward(self) -> None:
        # The plant's factor undoes FSDP's mean over dp ranks of losses that are shares of the global mean; a
        # shard-mean loss needs none (its factor divided by dp).
        mean = tasks.shard_mean(self.task, self.ref)
        factor = self.plant.loss_factor(self.layout.dp) / (self.layout.dp if mean else 1)
        (self.out.loss * factor).backward()

    def grads_checks(self) -> list:
        skip = self.backward_skip()
        if skip:
            return [CheckResult(CheckId.GRADS, Status.SKIP, skip)]
        return self._typed([localize.grads(self.model, self.expected["grads"], self.tol.atol, self.tol.rtol,
                                           self.layout)])

    def checkpoint(self) -> list:
        from paracheck.adapters.transformers.checkpoint import roundtrip

        # Reloads take the case's DistributedConfig rules, not its plant (a checkpoint control plants its own).
        return roundtrip(self, lambda path, layout: _load_parallel(path, layout, NO_PLANT, self.ctx.backend))

    def generate(self) -> list:
        from paracheck.adapters.transformers import generate

        if not self.task.generates:
            return [CheckResult(CheckId.GENERATE, Status.SKIP, f"a {self.task.name} model does not generate")]
        return self._typed(generate.run(self))

    def steps(self) -> list:
        from paracheck.adapters.transformers import steps

        return self._typed(steps.run(self))

    def localize(self, checks: list) -> None:
        localize.after_checks(self.model, self.ref, self.mine, self.layout, checks, self.ctx.result, self.tol.atol,
                              self.tol.rtol)


def _single_process(path: str, case, shape, layout, result) -> tuple:
    """(the checkpoint loaded on this rank alone, the global batch, the reference run's results). `result` takes
    the model's class first, so a reference run that raises still names it (known failures match on it)."""
    ref, variant = tasks.load(path, dtype=torch.float32), case.variant
    result.model_class = type(ref).__name__
    task = tasks.of_case(case.model, ref)
    if variant not in (taken := tasks.variants(task, ref)):
        why = (": its loss is each shard's own mean, and padded rows give the shards unequal token counts, whose means "
               "do not average to the whole batch's" if set(taken) < set(task.variants) else "")
        raise Refused(f"variant {variant}: this {task.name} model takes {', '.join(taken)}{why}")
    try:
        batch = tasks.with_labels(task, _batch(variant, shape, layout, ref.config.get_text_config().vocab_size),
                                  ref.config, seed=1)
    except ValueError as exc:  # rows too short for the task's inputs (an image's placeholders)
        raise Refused(f"{task.name} inputs: {exc}") from exc
    if variant == "embeds":
        batch = inputs.with_embeds(batch, ref.get_input_embeddings())
    return ref, batch, reference_run(ref, batch)


def _batch(variant: str, shape, layout, vocab: int) -> dict:
    """The global batch: the shape's rows where the case has one (explore, a found case), else the variant's."""
    if shape is None:
        return inputs.global_batch(variant, layout.dp, vocab)
    problems = cases.shape_problems(shape, layout.dp)
    if problems:
        raise Refused("; ".join(problems))
    return inputs.from_shape(shape, vocab)


def after_load(control, plant, model, layout):
    """`plant.after_load` on the parallel model: in a local world once per rank, acting as that rank, where `control`
    asks (`Control.per_rank`: its planter picks by its rank in Python), else once."""
    from paracheck.world.regions import as_control_asks

    return as_control_asks(control.per_rank, plant.after_load, model, layout)


def _load_parallel(path: str, layout, plant, backend):
    from transformers.distributed import DistributedConfig

    kwargs = config_kwargs(layout)
    if plant.tp_plan:
        kwargs["tp_plan"] = dict(plant.tp_plan)
    try:
        config = DistributedConfig(**kwargs)
    except (ValueError, TypeError) as exc:
        raise Refused(f"transformers refuses DistributedConfig({_kw(kwargs)}): {exc}") from exc
    device = torch.device(backend.device_for(int(os.environ.get("LOCAL_RANK", 0))))
    try:
        with library.world_meshes(meshes.for_world(), backend.device_type, device):
            return tasks.load(path, dtype=torch.float32, distributed_config=config)
    except (ValueError, NotImplementedError) as exc:
        # Plan and size rules transformers checks while loading; every rank raises the same.
        raise Refused(f"transformers refuses {_kw(kwargs)} for this model: {exc}") from exc


def _kw(kwargs: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in kwargs.items())


def reference_run(ref, batch: dict) -> dict:
    """The single-process run of the whole global batch: inference logits, then loss, logits and gradients."""
    with torch.no_grad():
        # use_cache=False in every pass, as a training step runs: transformers isolates packed documents (a
        # block-diagonal mask read from position_ids) only when it builds no cache.
        infer = ref(**inputs.without_labels(batch), use_cache=False).logits.detach()
    out = ref(**batch, use_cache=False)
    out.loss.backward()
    grads = {n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in ref.named_parameters()}
    return {"infer": infer, "loss": out.loss.detach(), "logits": out.logits.detach(), "grads": grads}



def _logits(check_id, actual, expected, layout, tol, what) -> CheckResult:
    if actual is None:
        return CheckResult(check_id, Status.SKIP, f"pp_size={layout.pp}: this stage returns no {what}")
    return compare(check_id, actual, expected, tol.atol, tol.rtol, what)
