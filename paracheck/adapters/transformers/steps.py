"""parity.steps for transformers: optimizer steps taken by transformers' own `Trainer` on the parallel model and on a
fresh single-process load of the same checkpoint, compared after every step.

The library's training code is what is under test, so both runs are `Trainer.train()` as its users call it, with
the same arguments: AdamW with weight decay, `max_grad_norm` low enough that every step clips (the norm is measured
and reported), a constant learning rate, two micro-batches per step (`gradient_accumulation_steps`, so the deferred
gradient sync runs), the sequential sampler, no saving, no reporting. The dataset holds fresh token rows for every
micro-batch; the reference's device batch is the global batch and the parallel run's is `rows / dp`, so accelerate's
sharding of the loader (contiguous, in data-parallel rank order; TP ranks alike) feeds both the same global batch
per micro-batch in the same order.

The reference `Trainer` runs in this rank's own process, on the CPU alone, although torch.distributed is up: accelerate
and `TrainingArguments` decide "distributed" from the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK, ...),
which `_single_process_env` hides while the reference is built and trained (transformers' own switch is the same
environment; no Trainer code is replaced). Each rank computes it (every rank has its own reference in this adapter)
and keeps the last few (`_STEPS`). After each optimizer step a callback (`on_step_end`, on every rank) gathers every
parameter to full shape, and `on_log` takes the step's loss and gradient norm as the Trainer logs them.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

import torch

from paracheck.checks.compare import compare
from paracheck.checks.shards import full
from paracheck.checks.steps import (EXCUSE_ATOLS, StepRecord, against_own_error, compare_steps, reference_error,
                                    widest_excuse)
from paracheck.domain.adapter import Refused
from paracheck.domain.records import BEYOND_PRECISION, CheckId, CheckResult, Failure, FailureKind, Status
from paracheck.world.recent import Recent
from paracheck.adapters.transformers import inputs
from paracheck.adapters.transformers.layout import config_kwargs

#: Micro-batches per optimizer step: two, so FSDP's deferred gradient sync (Trainer's `no_sync`) runs.
MICRO = 2
LEARNING_RATE = 1e-2
WEIGHT_DECAY = 0.1
#: Below the pre-clip gradient norm of every step on the bundled fixtures (measured: see docs/transformers.md),
#: so `clip_grad_norm_` does clip; each step's norm is in the check's data (`grad_norm`, `clipped`).
MAX_GRAD_NORM = 0.5
#: Adam's epsilon, raised from torch's 1e-8 so that fp32 rounding is not amplified past the tolerance. An element
#: moves by about lr * g / (|g| + eps), whose slope at g = 0 is lr / eps: a gradient near eps that the two runs
#: round differently (sums in another order: FSDP's shards, the experts' grouped tokens) parts by up to lr / eps
#: times its rounding. Measured (3 steps, lr 1e-2, 2 ranks): eps 1e-8: llama fsdp2 1.4e-5 (one element, gradient
#: 4e-9), qwen3_moe fsdp2 2.5e-5; 1e-6: qwen3_moe fsdp2 4.2e-5 (embedding elements with gradients near 2e-6);
#: 1e-4: at most 9.5e-7 on llama and qwen3_moe, fsdp2, dpr2, fsdp2xep2. AdamW stays AdamW (decoupled decay, the
#: moments, the bias correction); elements far below eps move as under SGD with rate lr / eps.
ADAM_EPSILON = 1e-4
#: What the float64 steps (`reference(wide=True)`) load with beyond the dtype: the experts' eager loop, as torch's
#: `grouped_mm` (transformers' default for a mixture of experts) takes no float64 ("Expected mat_a to be Float32,
#: BFloat16 or Float16 matrix"). The loop sums the same products in another order, which is all a measure of the
#: reference's rounding asks of it.
WIDE_LOAD = {"experts_implementation": "eager"}
#: The most a parallel run may part from the reference and pass where the reference is itself too imprecise for the
#: tolerance ("beyond", `checks.steps.against_own_error`): a tenth of one Adam step, so no wrong step ever passes.
BEYOND_CEILING = LEARNING_RATE / 10
#: The seed of the first micro-batch's rows (each micro-batch draws its own, after the case's own batch).
SEED = 100
#: The launcher's environment that makes accelerate and TrainingArguments treat a process as one of a world.
WORLD_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
             "ROLE_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "PMI_RANK", "PMI_SIZE",
             "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_RANK",
             "MV2_COMM_WORLD_SIZE", "MPI_LOCALRANKID", "ACCELERATE_USE_CPU", "ACCELERATE_TORCH_DEVICE")

#: This process's reference step records by (factory, checkpoint, variant, shape, dp, steps): a world runs a
#: fixture's layouts one after another, so neighbouring cases of one dp share them (and a control its plain case's).
_STEPS = Recent(3, "transformers steps trace")
#: The float64 steps a failed check measures the reference's own error by (`_within_own_error`), kept apart, so
#: that they take no float32 reference's place.
_WIDE = Recent(1, "transformers float64 steps")


class Recorder:
    """A `TrainerCallback` recording each optimizer step: every parameter whole (`on_step_end`, which every rank
    reaches), then the step's logged loss and gradient norm (`on_log`)."""

    def __init__(self):
        from transformers import TrainerCallback

        class _Callback(TrainerCallback):
            def on_step_end(inner, args, state, control, model=None, **kwargs):
                with torch.no_grad():
                    params = {n: full(p.detach()).clone().cpu()
                              for n, p in model.named_parameters(remove_duplicate=False)}
                self.records.append(StepRecord(None, params))

            def on_log(inner, args, state, control, logs=None, **kwargs):
                if logs and "loss" in logs and self.records:
                    self.records[-1].loss = torch.tensor(logs["loss"], dtype=torch.float32)
                    if logs.get("grad_norm") is not None:
                        self.records[-1].grad_norm = float(logs["grad_norm"])

        self.records: list[StepRecord] = []
        #: The evaluation loss before the steps and after them.
        self.evaluated: list[float] = []
        self.callback = _Callback()


def arguments(folder: str, rows: int, steps: int, use_cpu: bool):
    """The `TrainingArguments` both runs take (`rows`: this run's device batch)."""
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=folder, per_device_train_batch_size=rows, per_device_eval_batch_size=rows,
                             gradient_accumulation_steps=MICRO,
                             max_steps=steps, learning_rate=LEARNING_RATE, lr_scheduler_type="constant",
                             warmup_steps=0, weight_decay=WEIGHT_DECAY, adam_epsilon=ADAM_EPSILON,
                             max_grad_norm=MAX_GRAD_NORM, optim="adamw_torch", train_sampling_strategy="sequential", logging_strategy="steps",
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=use_cpu,
                             # the kit's batches label under "labels" alone; the Trainer's own guess reads every
                             # forward argument named *labels (Granite Docling's optional `router_labels` too) and
                             # computes no evaluation loss where one of them is absent
                             label_names=["labels"],
                             dataloader_num_workers=0, disable_tqdm=True, seed=0)


class Rows(torch.utils.data.Dataset):
    """Micro-batches of rows laid end to end, one row an item (the sequential sampler reads them in order): each
    item is `inputs.rows` of its batch (a packed tensor's block for that row among them), and `collate` is
    `inputs.joined`, so a device batch of consecutive rows is what `inputs.share` cuts for them."""

    def __init__(self, batches: list[dict]):
        self.rows = [inputs.rows(b, r, r + 1) for b in batches for r in range(inputs.rows_in(b))]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return self.rows[index]

    def collate(self, rows: list[dict]) -> dict:
        """The Trainer's collator: `rows` as one batch (`inputs.joined`)."""
        return inputs.joined(rows)


def batches(draw, steps: int) -> list[dict]:
    """`MICRO` global batches to evaluate on, then `steps * MICRO` global micro-batches to train on, fresh rows each
    (`draw(seed)` -> one global batch)."""
    return [draw(SEED + i) for i in range((steps + 1) * MICRO)]


def train(model, data: list[dict], rows: int, steps: int, use_cpu: bool, workdir: str, trainer_class=None,
          stand_in: "StandIn | None" = None) -> Recorder:
    """`Trainer.train()` on `model` over `data`, `rows` rows per device batch, with an evaluation before and after
    (as users train: the state a first forward leaves behind meets the optimizer); the step records. With a
    `stand_in`, the Trainer's Accelerator is built without the `ParallelismConfig` accelerate refuses, and the data
    is laid out so that its loader gives each rank its data-parallel share (`StandIn`)."""
    from transformers import Trainer

    recorder = Recorder()
    threads = torch.get_num_threads()  # accelerate sets its own count on a CPU world; the rank keeps its own
    rows_of = stand_in.per_rank if stand_in else (lambda batches: batches)
    with tempfile.TemporaryDirectory(dir=workdir, prefix="steps-") as folder:
        try:
            # Trainer builds its Accelerator here, which checks the model's parallelism against the world.
            with stand_in.building(model) if stand_in else contextlib.nullcontext():
                train_rows, eval_rows = Rows(rows_of(data[MICRO:])), Rows(rows_of(data[:MICRO]))
                trainer = (trainer_class or Trainer)(model=model, args=arguments(folder, rows, steps, use_cpu),
                                                     train_dataset=train_rows, eval_dataset=eval_rows,
                                                     data_collator=train_rows.collate, callbacks=[recorder.callback])
        except (ValueError, NotImplementedError) as exc:
            torch.set_num_threads(threads)
            raise TrainerRefused(f"{type(exc).__name__}: {exc}") from exc
        try:
            recorder.evaluated.append(trainer.evaluate()["eval_loss"])
            trainer.train()
            recorder.evaluated.append(trainer.evaluate()["eval_loss"])
        finally:
            torch.set_num_threads(threads)
            del trainer
            _forget_accelerate()  # the next case's Trainer, or none, starts from no state
    return recorder


def _forget_accelerate() -> None:
    """accelerate's process-wide singletons (`PartialState`, `AcceleratorState`, `GradientState`) reset."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


class TrainerRefused(Exception):
    """`Trainer(...)` raised before any step, alike on every rank: the library refuses this model on this world."""


@contextlib.contextmanager
def _single_process_env():
    """Within: no launcher environment, so accelerate's `PartialState` (which `TrainingArguments` resets) sees one
    process on one device; the environment comes back after."""
    saved = {k: os.environ.pop(k) for k in WORLD_ENV if k in os.environ}
    _forget_accelerate()
    try:
        yield
    finally:
        os.environ.update(saved)
        _forget_accelerate()


def reference(key, path: str, data: list[dict], rows: int, steps: int, workdir: str, wide: bool = False) -> Recorder:
    """The single-process run: a fresh load of `path` (never a case's shared reference model), trained alone on
    the CPU, where the adapter's other references run (`use_cpu`: on a GPU machine a single-process Trainer would
    otherwise take cuda:0, and with several GPUs visible wrap the model in DataParallel). `wide`: in float64
    (`WIDE_LOAD`), the batches' top-level floating tensors (pixels, audio features, embeddings) too; a nested one, or
    a model that upcasts inside, leaves part of it in float32, which understates the reference's error (the safe
    side); kept apart from the float32 runs (`_WIDE`)."""

    def compute():
        from paracheck.adapters.transformers import tasks

        batches = data if not wide else [
            {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in b.items()} for b in data]
        with _single_process_env():
            model = tasks.load(path, **(dict(WIDE_LOAD, dtype=torch.float64) if wide else dict(dtype=torch.float32)))
            return train(model, batches, rows, steps, True, workdir)

    return (_WIDE if wide else _STEPS).get(key, compute)


def check(actual: Recorder, expected: Recorder, atol: float, rtol: float, own_error: list | None = None,
          own_evaluated: list | None = None) -> CheckResult:
    """`compare_steps` (loss, gradient norm, every parameter; `own_error`, the reference's own per step), with whether
    each reference step clipped (a step that did not would leave the clipping untested), then the evaluation losses
    before and after the steps, each held against the reference's own error there (`own_evaluated`) where given."""
    result = compare_steps(actual.records, expected.records, atol, rtol, own_error, BEYOND_CEILING)
    norms = [r.grad_norm for r in expected.records]
    result.data.update(max_grad_norm=MAX_GRAD_NORM, clipped=[n is not None and n > MAX_GRAD_NORM for n in norms],
                       evaluated=actual.evaluated, reference_evaluated=expected.evaluated)
    if len(actual.evaluated) != len(expected.evaluated):
        result.detail = "; ".join(filter(None, (result.detail if result.status == Status.FAIL else "",
                                                f"{len(actual.evaluated)} evaluations recorded, the reference took "
                                                f"{len(expected.evaluated)}")))
        result.status = Status.FAIL
    for i, (mine, ref) in enumerate(zip(actual.evaluated, expected.evaluated)):
        when = ("before", "after")[min(i, 1)]
        held = compare(CheckId.STEPS, torch.tensor(mine), torch.tensor(ref), atol, rtol,
                       f"the evaluation loss {when} the steps")
        if held.status == Status.FAIL and result.status == Status.PASS:
            own = own_evaluated[i] if own_evaluated is not None and i < len(own_evaluated) else None
            _hold_evaluation(result, held, when, mine, ref, own, atol, rtol)
    return result


def _hold_evaluation(result: CheckResult, held: CheckResult, when: str, mine: float, ref: float, own, atol: float,
                     rtol: float) -> None:
    """`result` (passing steps) given a failed evaluation `held`: failed, unless it stands within the reference's own
    error there (`own`: the float32 evaluation's distance from the float64 one, `against_own_error`), which the
    detail then says."""
    how = None if own is None else against_own_error(torch.tensor(abs(mine - ref), dtype=torch.float64),
                                                      torch.tensor(atol + rtol * abs(ref), dtype=torch.float64),
                                                      own, atol, BEYOND_CEILING)
    if how is None:
        result.status, result.detail = Status.FAIL, f"{held.detail}: {mine:.6g} != reference {ref:.6g}"
        result.max_abs = max(result.max_abs or 0.0, held.max_abs or 0.0)
        return
    result.data.setdefault("evaluation_excused", {})[when] = {"max_abs": abs(mine - ref), "reference_error": own,
                                                              "as": how}
    if how == "beyond":
        result.data[BEYOND_PRECISION] = True
    result.detail = "; ".join(filter(None, (
        f"the evaluation loss {when} the steps ({mine:.6g} != reference {ref:.6g}) is within the tolerance plus twice "
        f"the reference's own rounding error there (its float64 evaluation is {own:.2e} away" +
        (f", past what the tolerance can judge: {EXCUSE_ATOLS} atol)" if how == "beyond" else ")"), result.detail)))


def skip(reason: str) -> list[CheckResult]:
    return [CheckResult(CheckId.STEPS, Status.SKIP, reason)]


def run(body) -> list[CheckResult]:
    """The pass for one case (`body`: the adapter's `_Body` after its checks): the Trainer's steps on the parallel
    model and on a fresh single-process load, compared at the case's tolerance; a failure judged again against the
    reference's own rounding error where that could explain it (`_within_own_error`)."""
    sampled = _samples_in_training(body.ref, body.batch)
    if sampled:  # decided alike on every rank: the same model, batch and seeds
        return skip(f"the model's training forward draws random numbers with no dropout on (its train-mode logits "
                    f"under two seeds part by {sampled:.2e}, as PhiMoE's sparsemixer, which samples its routing): no "
                    "parallel step can repeat one process's draws")
    mismatch = _broadcast_mismatch(body.model)
    if mismatch:
        return [CheckResult(CheckId.STEPS, Status.FAIL, mismatch, failure=Failure(FailureKind.CHECK, CheckId.STEPS,
                                                                                   site=BROADCAST_SITE))]
    data = batches(_drawer(body), body.case.steps)
    rows = inputs.rows_in(data[0])
    with body.ctx.phase("steps_reference"):  # within "steps": what the single-process run costs (0 when kept)
        expected = _reference_of(body, data, rows)
    trainer_class = body.plant.trainer_plant and body.plant.trainer_plant()
    # A raise inside train() is this check's failure, with the rank's traceback kept (the skeleton's rule).
    outcome, raised = body.ctx.attempt(lambda: _train_parallel(body, data, rows, trainer_class), CheckId.STEPS)
    actual, stand_in = outcome if raised is None else (None, None)
    result = _judged(body, actual, raised, expected, stand_in)
    if result.status == Status.FAIL and raised is None and not isinstance(actual, TrainerRefused):
        result = _within_own_error(body, result, actual, expected, stand_in,
                                   lambda: _reference_of(body, data, rows, wide=True))
    return [result]


def _samples_in_training(ref, batch: dict) -> float:
    """How far the single-process model's train-mode logits on `batch` move between two random seeds, beyond how far
    they move under one seed twice (a kernel's own noise): 0.0 where its training forward draws nothing, as
    parity.steps needs. Measured on a copy (a train-mode forward updates a BatchNorm's running statistics, and the
    reference is shared across cases); 0.0 where a dropout is still on, which is the kit's config to fix, not a
    skip. The largest over the ranks, so every rank decides alike."""
    import copy

    import torch.distributed as dist

    probe = copy.deepcopy(ref).train()
    moved = 0.0
    if not any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in probe.modules()):
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                outs = []
                for seed in (1, 1, 2):
                    torch.manual_seed(seed)
                    outs.append(probe(**inputs.without_labels(batch), use_cache=False).logits.float())
            noise, apart = float((outs[0] - outs[1]).abs().max()), float((outs[0] - outs[2]).abs().max())
            moved = apart if apart > 10 * noise else 0.0
        except Exception:  # a train-mode forward that raises here raises in the steps too, where it is reported
            moved = 0.0
    held = torch.tensor([moved])
    if dist.is_initialized():
        dist.all_reduce(held, op=dist.ReduceOp.MAX)
    return float(held[0])


def _drawer(body):
    """seed -> the case's global batch for one step: its shape's or its variant's rows, labelled for its task."""
    from paracheck.adapters.transformers import tasks

    case, layout = body.case, body.layout
    embed = body.ref.get_input_embeddings() if case.variant == "embeds" else None

    def draw(seed: int) -> dict:
        vocab = body.ref.config.get_text_config().vocab_size
        batch = (inputs.from_shape(case.shape, vocab, seed) if case.shape is not None
                 else inputs.global_batch(case.variant, layout.dp, vocab, seed))
        batch = tasks.with_labels(body.task, batch, body.ref.config, seed)
        return inputs.with_embeds(batch, embed) if embed is not None else batch
    return draw


def _reference_of(body, data: list[dict], rows: int, wide: bool = False):
    """The single-process steps on `data` (in float64 where `wide`), kept by what they depend on."""
    import json

    case = body.case
    shape = json.dumps(case.shape.to_json(), sort_keys=True) if case.shape is not None else None
    key = (case.factory, body.path, case.variant, shape, body.layout.dp, case.steps)
    return reference(key, body.path, data, rows, case.steps, body.ctx.site.workdir, wide)


def _within_own_error(body, result: CheckResult, actual, expected, stand_in, exact) -> CheckResult:
    """`result` (failed) judged again with the reference's own rounding error measured: the same single-process
    steps in float64 (`exact()`), each failing parameter and evaluation held against the float32 reference's
    distance from them (`checks.steps.against_own_error`). Not run where no own error could turn its first failing
    step (`_within_reach`: a planted control that parts past the excuse there); where the float64 steps raise,
    `result` with the reason."""
    atol, rtol = body.tol.atol, body.tol.rtol
    if not _within_reach(result, actual, expected, atol, rtol):
        return result
    try:
        with body.ctx.phase("steps_reference"):
            wide = exact()
    except Exception as exc:  # noqa: BLE001 - a model that does not run in float64: no measure, the failure stands
        result.data["reference_error"] = {"not_measured": f"the float64 steps raised {type(exc).__name__}: {exc}"}
        return result
    try:
        own = reference_error(expected.records, wide.records)
        if len(wide.evaluated) != len(expected.evaluated):
            raise ValueError(f"the wide run evaluated {len(wide.evaluated)} times, the reference "
                             f"{len(expected.evaluated)}")
    except ValueError as exc:
        result.data["reference_error"] = {"not_measured": str(exc)}
        return result
    evaluated = [abs(a - b) for a, b in zip(expected.evaluated, wide.evaluated)]
    again = _judged(body, actual, None, expected, stand_in, own, evaluated)
    worst = max(((s, n, float(e.max())) for s, step in enumerate(own, 1) for n, e in step.items()
                 if not bool(e.isnan().any())), key=lambda t: t[2], default=None)
    again.data["reference_error"] = dict({"step": worst[0], "parameter": worst[1], "max_abs": worst[2]}
                                         if worst else {}, evaluated=evaluated)
    return again


def _within_reach(result: CheckResult, actual, expected, atol: float, rtol: float) -> bool:
    """Whether the reference's own error could turn `result` (failed): its steps up to the first failing one pass
    with every parameter allowed the widest excuse (`checks.steps.widest_excuse`), or only an evaluation failed. So
    a run passes as "beyond" only from a step after one where it agreed within the reference's rounding."""
    if len(actual.records) != len(expected.records) or len(actual.evaluated) != len(expected.evaluated):
        return False
    first = result.data.get("first_step", len(expected.records))
    return compare_steps(actual.records[:first], expected.records[:first], atol, rtol,
                         widest_excuse(expected.records[:first], atol)).status == Status.PASS


def _train_parallel(body, data: list[dict], rows: int, trainer_class) -> tuple:
    """(the parallel model's steps, or the Trainer's refusal; the kit's stand-in where accelerate refused a TP model
    on a CPU world and the steps ran with it, else None)."""
    case, layout, ctx = body.case, body.layout, body.ctx
    use_cpu = ctx.backend.device_type == "cpu"
    try:
        return train(body.model, data, rows // layout.dp, case.steps, use_cpu, ctx.site.workdir, trainer_class), None
    except TrainerRefused as exc:
        if not (layout.tp > 1 and use_cpu):
            return exc, None
        stand_in = StandIn(str(exc), layout)
    try:
        return train(body.model, data, rows // layout.dp, case.steps, use_cpu, ctx.site.workdir, trainer_class,
                     stand_in), stand_in
    except TrainerRefused as exc:
        return TrainerRefused(f"{stand_in.refusal}; with the stand-in too: {exc}"), stand_in


def _judged(body, actual, raised, expected, stand_in, own_error: list | None = None,
            own_evaluated: list | None = None) -> CheckResult:
    """parity.steps from the parallel run's outcome: its raise, the Trainer's refusal (a skip; `Refused` where the
    case's control must trip it), else its steps against `expected`."""
    case, layout, ctx = body.case, body.layout, body.ctx
    if raised is not None:
        return CheckResult(CheckId.STEPS, Status.FAIL, f"Trainer.train() raised: {raised}", failure=raised.failure)
    if isinstance(actual, TrainerRefused):
        reason = (f"transformers' Trainer refuses the model loaded with DistributedConfig({_sizes(layout)}) on this "
                  f"{ctx.backend.name} world: {actual}")
        if body.control is not None and CheckId.STEPS in body.control.must_trip:
            raise Refused(f"{case.control}: {reason}")  # the bug it plants cannot show: a skip, not a miss
        return skip(reason)[0]
    result = check(actual, expected, body.tol.atol, body.tol.rtol, own_error, own_evaluated)
    if result.status == Status.FAIL:
        site = (_planned_as(result, body.ref, layout)
                or _loss_times_dp(result, layout, body.ref, body.tol.atol, body.tol.rtol))
        result.failure = Failure(FailureKind.CHECK, CheckId.STEPS, site=site)
    if stand_in is not None:
        result.data["stood_in"] = stand_in.describe()
    return result


class StandIn:
    """What the kit stands in for where accelerate refuses the Trainer of a tensor-parallel model on a CPU world: the
    `ParallelismConfig` transformers hands accelerate for it (accelerate accepts one on FSDP2, GPU-like devices and
    DeepSpeed only). The Trainer is built with the model's TP degree hidden (`library.trainer_without_tp`), so its
    Accelerator takes no `ParallelismConfig`; the Trainer still reads the degree from the model everywhere after
    (its loss scale and token count divide by it). What the config's mesh does for the data, the kit does: the
    loader shards the data over every rank, so each micro-batch is laid out rank by rank, each rank's slot holding its
    data-parallel share (TP peers the same rows). Everything else is the library's own: `train()`'s loop, the
    deferred gradient sync over two micro-batches, `training_step` and `compute_loss`, `_get_num_items_in_batch`,
    `_clip_grad_norm` over mixed meshes, `create_optimizer`, `evaluate`."""

    LIBRARY = ("Trainer.train loop", "gradient accumulation (deferred sync)", "training_step / compute_loss with the "
               "TP loss scale", "_get_num_items_in_batch (gather / tp)", "_clip_grad_norm over mixed meshes",
               "create_optimizer (AdamW)", "evaluate", "the model's TP gradient hooks")
    KIT = ("accelerate's ParallelismConfig: the Accelerator is built without it, and each rank's loader is handed "
           "its data-parallel share, which the config's mesh would pick",)

    def __init__(self, refusal: str, layout):
        self.refusal, self.layout = refusal, layout

    def building(self, model):
        from paracheck.adapters.transformers.library import trainer_without_tp

        return trainer_without_tp(model)

    def per_rank(self, batches: list[dict]) -> list[dict]:
        """Each global batch as the world's ranks' slots, in rank order, each slot that rank's data-parallel share."""
        layout = self.layout
        return [inputs.joined([inputs.share(b, layout.dp_index(r), layout.dp) for r in range(layout.world)])
                for b in batches]

    def describe(self) -> dict:
        """What the report says (`results.report`'s stand-in lines): why, what the kit stood in for, what ran as the
        library's."""
        return {"why": f"accelerate refuses the Trainer of a TP model on a CPU world ({self.refusal})",
                "kit": list(self.KIT), "library": list(self.LIBRARY)}


#: A failing step's site when every parameter it names is planned alike: the plan style, e.g.
#: "tp_plan:replicated_with_grad_allreduce" (what a known failure's `site` matches).
PLANNED = "tp_plan:{style}"


def _planned_as(result: CheckResult, ref, layout) -> str:
    """The TP plan style every failing parameter of the first failing step shares (`PLANNED`), or "" where they
    differ, one is unplanned, or the layout has no TP: a typed origin for the failure, not its text."""
    from paracheck.adapters.transformers.structure import style_of

    step = result.data.get("first_step")
    failing = result.data["steps"][step - 1].get("failing") if step else None
    if not failing or layout.tp == 1:
        return ""
    plan = dict(getattr(ref, "tp_plan", None) or {})
    styles = {style_of(name, plan, True) for name in failing}
    return PLANNED.format(style=styles.pop()) if len(styles) == 1 and None not in styles else ""


#: A failing step's site where the model's loss is the generic classification heads' plain mean, which the Trainer
#: takes for one summed over `num_items_in_batch` (its forward has **kwargs), and the first step's logged loss and
#: gradient norm are both `dp` times the reference's: the Trainer scaled it
#: (docs/upstream/transformers_trainer_mean_loss_scaled.md).
LOSS_TIMES_DP = "trainer:mean_loss_times_dp"


def _mean_loss_head(model) -> bool:
    """Whether `model` computes its loss as transformers' generic sequence, token or span classification heads do (a
    mean over the batch, no `num_items_in_batch`), or as a class of its own with a default-mean torch loss does
    (`tasks.own_mean_loss`), while its forward takes **kwargs (what the Trainer reads as a loss that sums): the cause
    `LOSS_TIMES_DP` names, read from the model, not from the figures."""
    import inspect

    from transformers import modeling_layers as layers

    from paracheck.adapters.transformers import tasks

    generic = tuple(getattr(layers, n) for n in ("GenericForSequenceClassification", "GenericForTokenClassification",
                                                 "GenericForQuestionAnswering") if hasattr(layers, n))
    takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in inspect.signature(type(model).forward).parameters.values())
    return takes_kwargs and (isinstance(model, generic) or tasks.own_mean_loss(model))


def _loss_times_dp(result: CheckResult, layout, model, atol: float, rtol: float) -> str:
    """`LOSS_TIMES_DP` where `model` has the cause (`_mean_loss_head`) and the steps part at step 1 with its loss and
    gradient norm each `dp` times the reference's (within the case's tolerance of the scaled figure), else "". Step 1
    alone: its figures come before any update, so a factor there is the scaling's, not a drift's."""
    first = (result.data.get("steps") or [{}])[0]
    figures = [(first.get(k), first.get(f"reference_{k}")) for k in ("loss", "grad_norm")]
    if layout.dp == 1 or result.data.get("first_step") != 1 or any(a is None or b is None for a, b in figures):
        return ""
    scaled = all(abs(a - layout.dp * b) <= atol + rtol * abs(layout.dp * b) for a, b in figures)
    return LOSS_TIMES_DP if scaled and _mean_loss_head(model) else ""


def _sizes(layout) -> str:
    return ", ".join(f"{k}={v}" for k, v in config_kwargs(layout).items())


#: Where `Trainer.train()` broadcasts the trainable parameters that are not DTensors, from rank 0, over the world.
BROADCAST_SITE = "transformers.trainer.Trainer._sync_replicated_trainable_parameters"


def _broadcast_mismatch(model) -> str | None:
    """Why `Trainer.train()` would abort this world, or None. For a model loaded with `DistributedConfig`, train()
    broadcasts every trainable parameter that is not a DTensor from rank 0 over the whole world (BROADCAST_SITE);
    where the ranks hold different such parameters (pipeline stages: each its own layers) the broadcasts do not
    match and gloo aborts the process (SIGABRT, every later case lost), so the kit asks first (one all_gather of
    shapes) and reports the failure instead of running it (docs/upstream/transformers_trainer_pp_broadcast.md)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    plain = [(n, tuple(p.shape)) for n, p in model.named_parameters()
             if p.requires_grad and not isinstance(p.data, DTensor)]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, [shape for _, shape in plain])
    if all(shapes == every[0] for shapes in every):
        return None
    first = next(r for r, shapes in enumerate(every) if shapes != every[0])
    return (f"not run: Trainer.train() would broadcast each non-DTensor trainable parameter from rank 0 over the "
            f"world ({BROADCAST_SITE}), but rank 0 holds {len(every[0])} such parameters and rank {first} "
            f"{len(every[first])} of other shapes (first {every[0][:1]} vs {every[first][:1]}): the broadcasts "
            f"mismatch and gloo aborts the process")
