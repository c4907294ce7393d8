"""One transformers case on one rank: load the checkpoint with and without `distributed_config`, run both, check.

The world is already up (the kit's worker, or a test, called `init_process_group`); transformers is handed
this world's meshes (`library.world_meshes`), so a world running many cases builds each shape's mesh once.
Every rank computes its own single-process reference from the same checkpoint (the fixtures are tiny), so no
reference crosses ranks, and keeps its last few for the cases that share them (`_REFERENCES`). Order on the
parallel model: structure, the inference forward (no_grad; the rowwise local path only runs there), gradients
cleared the optimizer's way, the training forward and backward, then loss, logits and every gradient
(DTensors gathered).
"""

from __future__ import annotations

import gc
import json
import os
import time
import traceback

import torch
import torch.distributed as dist

from paracheck.checks.compare import compare, tolerance
from paracheck.checks.traits import input_traits
from paracheck.launch.attribution import lost_peer
from paracheck.domain.records import CheckId, CheckResult, Failure, RankResult, RankStatus, Route, Status
from paracheck.adapters.transformers import cases, fixtures, inputs, library, localize, structure
from paracheck.world import meshes
from paracheck.world.recent import Recent
from paracheck.adapters.transformers.controls import CONTROLS, NO_PLANT, PLANTS


class Refused(Exception):
    """transformers (or the case's control) cannot run this case: a skip, in the refuser's words."""


def run_case(case, backend, site) -> RankResult:
    """The kit's rank-side entry point for a transformers case (`site`: a `world.site.CaseSite`); never raises.
    Afterwards destroys any process group no mesh holds (`Meshes.settle`), as the diffusers adapter does."""
    started = time.time()
    result = RankResult(site.index, dist.get_rank(), RankStatus.OK, route=Route.SHARDED_LOAD)
    groups = meshes.group_names()
    try:
        _run(case, backend, site.workdir, result)
    except Refused as exc:
        result.status, result.reason, result.raised_in_parallel = RankStatus.SKIP, str(exc), False
    except Exception as exc:
        result.status, result.reason = RankStatus.ERROR, f"{type(exc).__name__}: {exc}"
        # Typed where it happened, so explore names the bug by exception and frame, not by the rank's exit.
        result.traceback, result.failure = traceback.format_exc(), Failure.raised(exc)
        # A rank whose collective broke because a peer left did not cause the failure: it says so, and the
        # launcher blames the peer (as the diffusers adapter's ranks do).
        result.secondary = lost_peer(result.traceback + result.reason)
    gc.collect()  # the case's model first (its hooks make cycles): a group it still held would outlive destruction
    meshes.for_world().settle(groups)
    result.seconds = round(time.time() - started, 3)
    return result


def checkpoint(case, fixture: str, folder: str) -> str:
    """The case's checkpoint: the folder a pytest mixin wrote (`case.payload`), else the bundled `fixture`'s,
    which rank 0 writes into `folder` (once per run) while every rank waits for it."""
    if case.payload:
        return case.payload
    if dist.get_rank() == 0:
        fixtures.save(fixture, folder)
    dist.barrier()
    return os.path.join(folder, f"transformers-{fixture}")


def _run(case, backend, workdir: str, result: RankResult) -> None:
    layout, rank = case.layout, dist.get_rank()
    control = CONTROLS[case.control] if case.control else None
    plant = PLANTS[case.control] if case.control else NO_PLANT
    if control and (reason := control.skip_reason(layout)):
        raise Refused(reason)
    # The factory runs here too, as a diffusers spec's does on its ranks (a spec may bend this process).
    fixture, shape = (case.model, case.shape) if case.payload else cases.spec_inputs(case.factory, case.variant,
                                                                                     case.shape)
    path = checkpoint(case, fixture, os.path.dirname(os.path.abspath(workdir)))
    atol, rtol = tolerance(torch.float32, "cpu")
    atol, rtol = case.atol or atol, case.rtol or rtol
    with _phase(result, "reference"):
        # The factory is part of the key: a spec may bend the single-process model too.
        key = (case.factory, path, case.variant, json.dumps(shape.to_json(), sort_keys=True) if shape else None,
               layout.dp)
        ref, batch, expected = _REFERENCES.get(key, lambda: _single_process(path, case.variant, shape, layout))
        result.model_class = type(ref).__name__
        result.inputs = input_traits(batch)
        missing = [k for k in plant.needs_rules if k not in ref.tp_plan]
        if missing:
            raise Refused(f"{case.control}: {result.model_class}'s tp_plan has no rule for {', '.join(missing)}")
    result.raised_in_parallel = True  # from here on a raise may leave peers inside a collective (a refusal resets it)
    with _phase(result, "parallel"):
        model = _load_parallel(path, layout, plant, backend)
    if plant.after_load:
        plant.after_load(model, layout)
    with _phase(result, "checks"):
        checks = [structure.check_mesh(model, layout, rank), structure.check_placements(model, ref, layout)]
    mine = inputs.share(batch, layout.dp_index(rank), layout.dp)
    tokens = inputs.predicted_tokens(batch["labels"])
    with _phase(result, "parallel"):
        checks += _passes(model, mine, tokens, expected, layout, plant, rank, atol, rtol, case.grads)
    localize.after_checks(model, ref, mine, layout, checks, result, atol, rtol)  # issue 29: rerun with hooks
    result.checks = checks
    result.raised_in_parallel = False


def _single_process(path: str, variant: str, shape, layout) -> tuple:
    """(the checkpoint loaded on this rank alone, the global batch, the reference run's results)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    batch = _batch(variant, shape, layout, ref.config.vocab_size)
    if variant == "embeds":
        batch = inputs.with_embeds(batch, ref.get_input_embeddings())
    return ref, batch, _reference(ref, batch)


#: This process's single-process references, by what they depend on: the factory and checkpoint, the variant,
#: the drawn shape and the data-parallel degree (the rows of the global batch). A world runs a fixture's layouts
#: one after another, so neighbouring cases often share one. Nothing in a case writes to one (controls plant
#: into the parallel model only); a few tiny models, so memory stays flat.
_REFERENCES = Recent(3)


def _batch(variant: str, shape, layout, vocab: int) -> dict:
    """The global batch: the shape's rows where the case has one (explore, a found case), else the variant's."""
    if shape is None:
        return inputs.global_batch(variant, layout.dp, vocab)
    problems = cases.shape_problems(shape, layout.dp)
    if problems:
        raise Refused("; ".join(problems))
    return inputs.from_shape(shape, vocab)


def _load_parallel(path: str, layout, plant, backend):
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    kwargs = layout.config_kwargs()
    if plant.tp_plan:
        kwargs["tp_plan"] = dict(plant.tp_plan)
    try:
        config = DistributedConfig(**kwargs)
    except (ValueError, TypeError) as exc:
        raise Refused(f"transformers refuses DistributedConfig({_kw(kwargs)}): {exc}") from exc
    device = torch.device(backend.device_for(int(os.environ.get("LOCAL_RANK", 0))))
    try:
        with library.world_meshes(meshes.for_world(), backend.device_type, device):
            return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, distributed_config=config)
    except (ValueError, NotImplementedError) as exc:
        # Plan and size rules transformers checks while loading; every rank raises the same.
        raise Refused(f"transformers refuses {_kw(kwargs)} for this model: {exc}") from exc


def _kw(kwargs: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in kwargs.items())


def _reference(ref, batch: dict) -> dict:
    """The single-process run of the whole global batch: inference logits, then loss, logits and gradients."""
    with torch.no_grad():
        # use_cache=False in every pass, as a training step runs: transformers isolates packed documents (a
        # block-diagonal mask read from position_ids) only when it builds no cache.
        infer = ref(**_model_inputs(batch), use_cache=False).logits.detach()
    out = ref(**batch, use_cache=False)
    out.loss.backward()
    grads = {n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in ref.named_parameters()}
    return {"infer": infer, "loss": out.loss.detach(), "logits": out.logits.detach(), "grads": grads}


def _model_inputs(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k != "labels"}


def _passes(model, mine: dict, tokens: int, expected: dict, layout, plant, rank: int, atol, rtol,
            grads: bool = True) -> list:
    dp_index = layout.dp_index(rank)
    ref_infer = inputs.share({"x": expected["infer"]}, dp_index, layout.dp)["x"]
    ref_logits = inputs.share({"x": expected["logits"]}, dp_index, layout.dp)["x"]
    with torch.no_grad():
        infer = _full(model(**_model_inputs(mine), use_cache=False).logits)
    checks = [_logits(CheckId.INFERENCE, infer, ref_infer, layout, atol, rtol, "no_grad logits")]
    # The optimizer's way (set_to_none), not model.zero_grad(): FSDP2 groups kept unsharded after a no_grad
    # forward make model.zero_grad() miss the sharded gradients.
    torch.optim.SGD(model.parameters(), lr=0.0).zero_grad(set_to_none=True)
    out = model(**mine, num_items_in_batch=tokens, use_cache=False)
    checks.append(_logits(CheckId.FORWARD, _full(out.logits), ref_logits, layout, atol, rtol, "logits"))
    if out.loss is None:
        # A failure, declared in known_failures.toml for pipeline layouts: labels were given, no loss came back.
        missing = f"labels given, but the forward returned no loss (pp_size={layout.pp})"
        return checks + [CheckResult(CheckId.LOSS, Status.FAIL, missing),
                         CheckResult(CheckId.GRADS, Status.SKIP, "no loss to take gradients of")]
    total = out.loss.detach().clone()
    dist.all_reduce(total)  # each data shard's loss counted once per rank holding it: world / dp times
    checks.append(compare(CheckId.LOSS, total / (layout.world // layout.dp), expected["loss"], atol, rtol, "loss"))
    if not grads:
        return checks + [CheckResult(CheckId.GRADS, Status.SKIP, "--no-grads")]
    (out.loss * plant.loss_factor(layout.dp)).backward()
    checks.append(localize.grads(model, expected["grads"], atol, rtol, layout))  # issue 29: with its table
    return checks


def _logits(check_id, actual, expected, layout, atol, rtol, what) -> CheckResult:
    if actual is None:
        return CheckResult(check_id, Status.SKIP, f"pp_size={layout.pp}: this stage returns no {what}")
    return compare(check_id, actual, expected, atol, rtol, what)


def _full(tensor):
    """A DTensor gathered whole; a plain tensor as is (a pipeline stage before the last may give None)."""
    if tensor is None:
        return None
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class _phase:
    """Adds the wall and CPU seconds spent inside the `with` to `result.timings[name]` and `[name_cpu]`."""

    def __init__(self, result: RankResult, name: str):
        self.result, self.name = result, name

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def __exit__(self, *exc):
        for key, spent in ((self.name, time.perf_counter() - self.wall),
                           (f"{self.name}_cpu", time.process_time() - self.cpu)):
            self.result.timings[key] = round(self.result.timings.get(key, 0.0) + spent, 4)
