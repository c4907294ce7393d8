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

from paracheck.checks.shards import full
from paracheck.checks.steps import StepRecord, compare_steps
from paracheck.domain.adapter import Refused
from paracheck.domain.records import CheckId, CheckResult, Failure, FailureKind, Status
from paracheck.world.recent import Recent

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
#: The seed of the first micro-batch's rows (each micro-batch draws its own, after the case's own batch).
SEED = 100
#: The launcher's environment that makes accelerate and TrainingArguments treat a process as one of a world.
WORLD_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
             "ROLE_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "PMI_RANK", "PMI_SIZE",
             "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_RANK",
             "MV2_COMM_WORLD_SIZE", "MPI_LOCALRANKID", "ACCELERATE_USE_CPU", "ACCELERATE_TORCH_DEVICE")

#: This process's reference step records by (factory, checkpoint, variant, shape, dp, steps): a world runs a
#: fixture's layouts one after another, so neighbouring cases of one dp share them (and a control its plain case's).
_STEPS = Recent(3)


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
        self.callback = _Callback()


def arguments(folder: str, rows: int, steps: int, use_cpu: bool):
    """The `TrainingArguments` both runs take (`rows`: this run's device batch)."""
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=folder, per_device_train_batch_size=rows, gradient_accumulation_steps=MICRO,
                             max_steps=steps, learning_rate=LEARNING_RATE, lr_scheduler_type="constant",
                             warmup_steps=0, weight_decay=WEIGHT_DECAY, adam_epsilon=ADAM_EPSILON,
                             max_grad_norm=MAX_GRAD_NORM, optim="adamw_torch", train_sampling_strategy="sequential", logging_strategy="steps",
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=use_cpu,
                             dataloader_num_workers=0, disable_tqdm=True, seed=0)


class Rows(torch.utils.data.Dataset):
    """Micro-batches of rows laid end to end, one row an item (the sequential sampler reads them in order)."""

    def __init__(self, batches: list[dict]):
        self.rows = [{k: v[r] for k, v in b.items()} for b in batches for r in range(next(iter(b.values())).shape[0])]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return self.rows[index]


def batches(draw, steps: int) -> list[dict]:
    """`steps * MICRO` global micro-batches, fresh rows each (`draw(seed)` -> one global batch)."""
    return [draw(SEED + i) for i in range(steps * MICRO)]


def train(model, data: list[dict], rows: int, steps: int, use_cpu: bool, workdir: str, trainer_class=None) -> Recorder:
    """`Trainer.train()` on `model` over `data`, `rows` rows per device batch; the step records."""
    from transformers import Trainer, default_data_collator

    recorder = Recorder()
    threads = torch.get_num_threads()  # accelerate sets its own count on a CPU world; the rank keeps its own
    with tempfile.TemporaryDirectory(dir=workdir, prefix="steps-") as folder:
        try:
            # Trainer builds its Accelerator here, which checks the model's parallelism against the world.
            trainer = (trainer_class or Trainer)(model=model, args=arguments(folder, rows, steps, use_cpu),
                                                 train_dataset=Rows(data), data_collator=default_data_collator,
                                                 callbacks=[recorder.callback])
        except (ValueError, NotImplementedError) as exc:
            torch.set_num_threads(threads)
            raise TrainerRefused(f"{type(exc).__name__}: {exc}") from exc
        try:
            trainer.train()
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


def reference(key, path: str, data: list[dict], rows: int, steps: int, workdir: str) -> Recorder:
    """The single-process run: a fresh load of `path` (never a case's shared reference model), trained alone on
    the CPU, where the adapter's other references run (`use_cpu`: on a GPU machine a single-process Trainer would
    otherwise take cuda:0, and with several GPUs visible wrap the model in DataParallel)."""

    def compute():
        from transformers import AutoModelForCausalLM

        with _single_process_env():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            return train(model, data, rows, steps, True, workdir)

    return _STEPS.get(key, compute)


def check(actual: Recorder, expected: Recorder, atol: float, rtol: float) -> CheckResult:
    """`compare_steps` (loss, gradient norm, every parameter), with whether each reference step clipped: a step
    that did not would leave the clipping untested."""
    result = compare_steps(actual.records, expected.records, atol, rtol)
    norms = [r.grad_norm for r in expected.records]
    result.data.update(max_grad_norm=MAX_GRAD_NORM, clipped=[n is not None and n > MAX_GRAD_NORM for n in norms])
    return result


def skip(reason: str) -> list[CheckResult]:
    return [CheckResult(CheckId.STEPS, Status.SKIP, reason)]


def run(body) -> list[CheckResult]:
    """The pass for one case (`body`: the adapter's `_Body` after its checks): the Trainer's steps on the parallel
    model and on a fresh single-process load, compared at the case's tolerance."""
    import json

    from paracheck.adapters.transformers import inputs

    case, layout, ctx = body.case, body.layout, body.ctx
    embed = body.ref.get_input_embeddings() if case.variant == "embeds" else None

    def draw(seed: int) -> dict:
        vocab = body.ref.config.vocab_size
        batch = (inputs.from_shape(case.shape, vocab, seed) if case.shape is not None
                 else inputs.global_batch(case.variant, layout.dp, vocab, seed))
        return inputs.with_embeds(batch, embed) if embed is not None else batch

    mismatch = _broadcast_mismatch(body.model)
    if mismatch:
        return [CheckResult(CheckId.STEPS, Status.FAIL, mismatch, failure=Failure(FailureKind.CHECK, CheckId.STEPS,
                                                                                   site=BROADCAST_SITE))]
    data = batches(draw, case.steps)
    rows = next(iter(data[0].values())).shape[0]
    use_cpu = ctx.backend.device_type == "cpu"
    shape = json.dumps(case.shape.to_json(), sort_keys=True) if case.shape is not None else None
    key = (case.factory, body.path, case.variant, shape, layout.dp, case.steps)
    with ctx.phase("steps_reference"):  # within "steps": what the single-process run costs (0 when kept)
        expected = reference(key, body.path, data, rows, case.steps, ctx.site.workdir)
    trainer_class = body.plant.trainer_plant and body.plant.trainer_plant()

    def parallel():
        try:
            return train(body.model, data, rows // layout.dp, case.steps, use_cpu, ctx.site.workdir, trainer_class)
        except TrainerRefused as exc:
            return exc

    # A raise inside train() is this check's failure, with the rank's traceback kept (the skeleton's rule).
    actual, raised = ctx.attempt(parallel, CheckId.STEPS)
    if raised is not None:
        return [CheckResult(CheckId.STEPS, Status.FAIL, f"Trainer.train() raised: {raised}", failure=raised.failure)]
    if isinstance(actual, TrainerRefused):
        reason = (f"transformers' Trainer refuses the model loaded with DistributedConfig({_sizes(layout)}) on this "
                  f"{ctx.backend.name} world: {actual}")
        if body.control is not None and CheckId.STEPS in body.control.must_trip:
            raise Refused(f"{case.control}: {reason}")  # the bug it plants cannot show: a skip, not a miss
        return skip(reason)
    return [check(actual, expected, body.tol.atol, body.tol.rtol)]


def _sizes(layout) -> str:
    return ", ".join(f"{k}={v}" for k, v in layout.config_kwargs().items())


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
