"""`checkpoint.roundtrip` for the transformers adapter: the parallel model saved and loaded back the library's
ways, every part held to the single-device model.

The parts, in order, each in a folder of its own under the case's workdir (rank 0's, so every rank agrees),
removed after it, also when it raises:

  (a) gathered: `save_pretrained(dir)` called on every rank (transformers gathers, rank 0 writes), read back on
      one device with `from_pretrained`: the safetensors' names and shapes those of the single-device checkpoint,
      every tensor the reference's.
  (b) sharded: `save_pretrained(dir, distributed_checkpoint=True)` (DCP: each rank writes its shards), read back
      on one device (`from_pretrained` detects the shards; DCP reads them on every rank).
  (c) that checkpoint loaded with `from_pretrained(distributed_config=...)` on the case's layout, and
  (d) on another layout of the same world (`layout.reload_layout`): every tensor, gathered whole, and the
      no_grad logits of the whole global batch the reference's; the stages' names together cover the model.
  (e) resume: one AdamW step on the case's layout, the model and the optimizer saved through the library's
      distributed save (`distributed_checkpoint=True`, `save_optimizer_distributed`), loaded on the other layout
      (`load_optimizer_distributed`), one more step; held to two steps on one device (`checks.steps`). One step
      before the save is enough: it leaves every moment AdamW keeps nonzero, and a state the load loses or
      misplaces moves the step after it; the steps before a save are parity.steps' to check.

One `CheckResult` per case: the verdict merges a check id's results into one anyway; `data["parts"]` keeps each
part's outcome (pass, fail, refused, blocked), its figures and seconds, and `data["notes"]` what transformers
refuses along the way in its own words (its Trainer's refusal to checkpoint an optimizer for these models).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import math
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
# A BaseException (not an Exception): every rank's DCP raise, gathered; caught by name, or it ends the rank.

from paracheck.checks.compare import compare, compare_named
from paracheck.checks.shards import full
from paracheck.checks.steps import StepRecord, compare_steps
from paracheck.checks.trainloop import clip, total_norm, whole_params
from paracheck.checks.wholes import wholes
from paracheck.domain.adapter import Refused
from paracheck.domain.records import CheckId, CheckResult, Failure, FailureKind, Status
from paracheck.adapters.transformers import inputs, tasks
from paracheck.adapters.transformers import fitting
from paracheck.adapters.transformers.layout import cp_supported, reload_layout
from paracheck.rank.skeleton import RAISES

PARTS = {"a": "gathered save_pretrained, read on one device", "b": "DCP save, read on one device",
         "c": "DCP load on the same layout", "d": "DCP load on another layout",
         "e": "resume on another layout from the library's distributed save of model and optimizer"}
#: (e): steps before the save, after the load; AdamW's learning rate and the gradient clip every step takes.
#: AdamW divides by the gradient's own size (m / (sqrt(v) + eps)), so with torch's eps (1e-8) an element whose
#: gradient is rounding noise around zero moves by up to ~lr with the noise's sign: two runs whose gradients agree to
#: 1e-7 part by up to 2 x lr there (measured: llama tp4 at lr 1e-3, 1.03e-5 at step 2; olmo3 tp4 at 1e-4, an
#: o_proj element 1.64e-5 at step 1, its gradient ~1e-9 on both sides, opposite signs). So eps is the root mean
#: square of the reference's first clipped gradient (`_eps`, as the kit's own optimizer loop sets it,
#: `checks.trainloop.Settings`): a gradient error d then moves an update by at most lr x d / eps, while a resume that
#: loses or misplaces the optimizer state still moves the elements whose gradient is of the usual size by a good
#: share of lr (95 times atol on llama tp4).
BEFORE, AFTER, LR, MAX_NORM = 1, 1, 1e-3, 1.0


@dataclass
class Part:
    status: str  # pass, fail, refused (the library or the world cannot run it), blocked (an earlier part failed)
    detail: str = ""
    max_abs: float = 0.0
    max_rel: float = 0.0
    seconds: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


def roundtrip(body, load) -> list[CheckResult]:
    """The pass on `body` (the case's `_Body`); `load(path, layout)`: the checkpoint at `path` loaded with
    `from_pretrained(distributed_config=...)` on `layout`, on this world's meshes."""
    return [_Roundtrip(body, load).run()]


#: The typed site of a resumed optimizer load whose every missing key is the state of a parameter that never got a
#: gradient before the save (transformers' `load_optimizer_distributed` asks for every parameter's state; declared
#: upstream: docs/upstream/transformers_optimizer_load_unused_params.md).
UNTRAINED_STATE_SITE = "checkpoint:optimizer_state_of_untrained_params"
_MISSING_STATE = re.compile(r"optimizer\.state\.(\S+?)\.(?:exp_avg_sq|exp_avg|step)\b")


class UntrainedStateMissing(RuntimeError):
    """The optimizer load raised for the state of untrained parameters only (`UNTRAINED_STATE_SITE`)."""


def _untrained_only(exc: BaseException, untrained: set) -> bool:
    """Whether every optimizer-state key `exc` says is missing names a parameter in `untrained` (and one does)."""
    named = set(_MISSING_STATE.findall(str(exc)))
    return bool(named) and named <= untrained


class _Roundtrip:
    def __init__(self, body, load):
        self.body, self.tol, self.layout, self.load = body, body.tol, body.layout, load
        self.plant = body.plant
        self.root = _agreed(body.ctx.site.workdir)
        self.reference = body.ref.state_dict()  # read only: the reference is shared across cases
        self.rows = inputs.rows_in(body.batch)
        config = body.ref.config
        self.other = reload_layout(self.layout, dist.get_world_size(), bool(getattr(body.ref, "ep_plan", None)),
                                   cp_supported(), self.rows,
                                   fits=lambda other: fitting.refusal(config, fitting.Need.of(other)) is None)
        self.parts: dict[str, Part] = {}
        self.notes: list[str] = []
        self.failure: Failure | None = None
        agreement_group()  # every rank, before any part may raise

    def run(self) -> CheckResult:
        # A steps pass before this one may have moved the parallel model on; then save a fresh load of it.
        source = self._load(self.body.path, self.layout, plant=False) if self.body.case.steps else self.body.model
        self._part("a", lambda: self._gathered(source))
        with _folder(self.root, "sharded") as path:
            if self._part("b", lambda: self._sharded(source, path)):
                self._part("c", lambda: self._reloaded(path, self.layout))
                self._part("d", lambda: self._reloaded(path, self.other))
            else:
                for name in "cd":
                    self.parts[name] = Part("blocked", "(b) did not leave a checkpoint to load")
        source = None  # freed before the resume loads the model again
        self._part("e", self._resume)
        return _verdict(self.parts, self.notes, self.other, self.tol, self.failure)

    def _part(self, name: str, step) -> bool:
        started = time.perf_counter()
        try:
            part = step()
        except RAISES as exc:  # a part's raise is its failure (a control's bug may raise; DCP's is a BaseException)
            if not peers_raised_too(name):
                # A peer is still inside the library's collective: the case ends here as a pass's raise does (an
                # error keeping this rank's checks; a refusal re-raised as itself would read as a skip).
                raise RuntimeError(f"checkpoint part ({name}) raised {type(exc).__name__}: {exc}; a peer did not "
                                   f"reach the agreement within {AGREE_SECONDS:.0f} s") from exc
            part = Part("refused", str(exc)) if isinstance(exc, Refused) else self._raised(exc)
        part.seconds = round(time.perf_counter() - started, 3)
        self.parts[name] = part
        gc.collect()
        return part.status == "pass"

    def _raised(self, exc: BaseException) -> Part:
        """A part's raise as its failure, the case's typed by the first."""
        typed = Failure(FailureKind.RAISE, CheckId.CHECKPOINT, type(exc.__cause__).__name__, UNTRAINED_STATE_SITE) \
            if isinstance(exc, UntrainedStateMissing) else Failure.raised(exc, CheckId.CHECKPOINT)
        self.failure = self.failure or typed
        return Part("fail", f"raised {type(exc).__name__}: {exc}")

    # -- the parts ------------------------------------------------------------------------------------------

    def _gathered(self, model) -> Part:
        with _folder(self.root, "gathered") as path:
            with _planted(self.plant.save_plant, model):
                model.save_pretrained(path)
            dist.barrier()  # transformers waits for its writer under tp, dp and ep only, not under pp
            problems = _names_and_shapes(path, self.body.path)
            try:
                loaded = tasks.load(path, dtype=torch.float32)
            except Exception as exc:  # what it read is what is wrong: the names and shapes say it first
                if not problems:
                    raise
                return Part("fail", "; ".join(problems + [f"from_pretrained raises {type(exc).__name__}"]))
            return self._held(dict(loaded.state_dict()), problems)

    def _sharded(self, model, path: str) -> Part:
        with _planted(self.plant.dcp_save_plant, model):
            self._save_sharded(model, path)
        loaded = tasks.load(path, dtype=torch.float32)
        return self._held(dict(loaded.state_dict()), [])

    def _save_sharded(self, model, path: str) -> None:
        try:
            model.save_pretrained(path, distributed_checkpoint=True)
        except ValueError as exc:
            # transformers 5.24 refuses a model sharded neither by tp nor by dp (pipeline stages alone) before
            # writing; its DCP writer, which that call runs, takes any model: save through it, and say so.
            from transformers.distributed.checkpoint import _save_model_checkpoint_distributed

            self.notes.append(f"(b) transformers refuses save_pretrained(distributed_checkpoint=True) on "
                              f"{self.layout}: {exc} Saved through its DCP writer "
                              "(transformers.distributed.checkpoint._save_model_checkpoint_distributed) instead")
            dist.barrier()  # rank 0 wrote the config before the refusal
            _save_model_checkpoint_distributed(model, path)

    def _reloaded(self, path: str, layout) -> Part:
        if layout is None:
            raise Refused(f"no other layout of {dist.get_world_size()} ranks that transformers builds for this "
                          f"model takes the {self.rows}-row batch")
        model = self._load(path, layout)
        state = wholes(model.state_dict())
        names = [None] * dist.get_world_size()
        dist.all_gather_object(names, sorted(state))
        problems = []
        with torch.no_grad():
            logits = full(model(**inputs.without_labels(self.body.batch), use_cache=False).logits)
        check = compare(CheckId.CHECKPOINT, logits, self.body.expected["infer"], self.tol.atol, self.tol.rtol,
                        "no_grad logits")
        if check.status == Status.FAIL:
            problems.append(f"{layout}: {check.detail} (max_abs {check.max_abs or 0.0:.2e})")
        part = self._held(state, problems, {n for ranks in names for n in ranks}, where=f"{layout}: ")
        part.max_abs = max(part.max_abs, check.max_abs or 0.0)
        part.max_rel = max(part.max_rel, check.max_rel or 0.0)
        return part

    def _resume(self) -> Part:
        from transformers.distributed.checkpoint import load_optimizer_distributed, save_optimizer_distributed

        if self.layout.pp > 1:
            raise Refused(f"pp_size={self.layout.pp}: the pipeline forward returns no loss to train on "
                          "(declared upstream: parity.loss on pp*)")
        if self.other is None:
            raise Refused(f"no other layout of {dist.get_world_size()} ranks to resume on")
        expected, eps = _reference_steps(self.body.path, self.body.batch, BEFORE + AFTER, self.body.task)
        model = self._load(self.body.path, self.layout, plant=False)
        with _folder(self.root, "resume") as path:
            self.notes.append(_trainer_refusal(model, os.path.join(path, "trainer")))
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=eps)
            records = [_step(model, optimizer, self.body.batch, self.layout, self.body.task) for _ in range(BEFORE)]
            untrained = {name for name, p in model.named_parameters() if not optimizer.state.get(p)}
            with _planted(self.plant.dcp_save_plant, model):
                model.save_pretrained(os.path.join(path, "model"), distributed_checkpoint=True)
            save_optimizer_distributed(model, optimizer, os.path.join(path, "optimizer"))
            del model, optimizer
            model = self._load(os.path.join(path, "model"), self.other)
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=eps)
            try:
                with _planted(self.plant.optimizer_load_plant):
                    load_optimizer_distributed(model, optimizer, os.path.join(path, "optimizer"))
            except RAISES as exc:
                if _untrained_only(exc, untrained):
                    raise UntrainedStateMissing(str(exc)) from exc
                raise
            records += [_step(model, optimizer, self.body.batch, self.other, self.body.task) for _ in range(AFTER)]
        steps = compare_steps(records, expected, self.tol.atol, self.tol.rtol)
        detail = f"{self.layout} -> {self.other}: {steps.detail}" if steps.detail else ""
        return Part(steps.status.value, detail, steps.max_abs or 0.0, steps.max_rel or 0.0)

    # -- shared -------------------------------------------------------------------------------------------

    def _load(self, path: str, layout, plant: bool = True):
        with _planted(self.plant.dcp_load_plant if plant else None):
            return self.load(path, layout)

    def _held(self, state: dict, problems: list, names: set | None = None, where: str = "") -> Part:
        """`state` (name -> whole tensor) against the reference's; `names`: every name the ranks hold together
        (a pipeline stage holds its own), else `state`'s."""
        held = compare_named(CheckId.CHECKPOINT, state, self.reference, self.tol.atol, self.tol.rtol, names)
        if held.missing:
            problems.append(f"{where}{len(held.missing)} of {len(self.reference)} tensors missing "
                            f"({_few(held.missing)})")
        if held.extra:
            problems.append(f"{where}{len(held.extra)} tensors the single-device model lacks ({_few(held.extra)})")
        if held.failing:
            size, name, detail = held.failing[0]
            worst = detail if size == float("inf") else f"worst {name}, max_abs {size:.2e}"
            problems.append(f"{where}{len(held.failing)} tensor(s) differ from the reference's: {worst}")
        return Part("fail" if problems else "pass", "; ".join(problems), held.max_abs, held.max_rel)


def _verdict(parts: dict, notes: list, other, tol, failure) -> CheckResult:
    failing = [n for n in parts if parts[n].status == "fail"]
    refused = [n for n in parts if parts[n].status == "refused"]
    worst_abs = max(p.max_abs for p in parts.values())
    worst_rel = max(p.max_rel for p in parts.values())
    data = {"parts": {n: p.to_json() for n, p in parts.items()}, "reload_layout": other.name if other else None,
            "notes": [n for n in notes if n]}
    not_run = "; ".join(f"({n}) not run: {parts[n].detail}" for n in refused)
    if failing:
        # The parts failing, named first: a known failure of one part alone matches "failing (a): *".
        named = [f"({n}) {parts[n].detail}" for n in failing] if len(failing) > 1 else [parts[failing[0]].detail]
        detail = f"failing {', '.join(f'({n})' for n in failing)}: " + "; ".join(named + ([not_run] if not_run else []))
        return CheckResult(CheckId.CHECKPOINT, Status.FAIL, detail, worst_abs, worst_rel, tol.atol, tol.rtol, data,
                           failure)
    status = Status.SKIP if refused else Status.PASS
    detail = "; ".join(filter(None, [not_run] + ([f"passed {', '.join(f'({n})' for n in parts if n not in refused)}"]
                                                 if refused else []) + data["notes"]))
    return CheckResult(CheckId.CHECKPOINT, status, detail, worst_abs, worst_rel, tol.atol, tol.rtol, data)


# -- steps (e) -----------------------------------------------------------------------------------------------


def _reference_steps(path: str, batch: dict, count: int, task) -> tuple[list[StepRecord], float]:
    """`count` steps of a fresh single-device load of the checkpoint (the shared reference is left alone), and the
    AdamW eps they took (`_eps`, set at the first step, before it is used)."""
    model = tasks.load(path, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    counted = tasks.loss_kwargs(task, batch["labels"])
    records = []
    for _ in range(count):
        optimizer.zero_grad(set_to_none=True)
        loss = model(**batch, **counted, use_cache=False).loss
        loss.backward()
        clip(list(model.parameters()), MAX_NORM)
        if not records:
            optimizer.param_groups[0]["eps"] = _eps(model)
        optimizer.step()
        records.append(StepRecord(loss.detach().clone(), whole_params(model)))
    return records, optimizer.param_groups[0]["eps"]


def _eps(model) -> float:
    """The root mean square of `model`'s (clipped) gradient: AdamW's eps for (e), so rounding noise in a gradient
    near zero cannot flip a step (the comment above `LR`); torch's own 1e-8 where every gradient is zero (eps 0 would
    divide zero by zero)."""
    params = [p for p in model.parameters() if p.grad is not None]
    count = sum(p.grad.numel() for p in params)
    return (float(total_norm(params)) / math.sqrt(count) if count else 0.0) or 1e-8


def _step(model, optimizer, batch: dict, layout, task) -> StepRecord:
    """One step of the parallel model on this rank's share of the global batch; the loss, like the reference's,
    the global mean (the ranks' shares summed, each counted once)."""
    rank = dist.get_rank()
    mine = inputs.share(batch, layout.dp_index(rank), layout.dp)
    optimizer.zero_grad(set_to_none=True)
    loss = model(**mine, **tasks.loss_kwargs(task, batch["labels"]), use_cache=False).loss
    # FSDP averages gradients over the dp ranks: a loss that is a share of the global mean is scaled back up.
    mean = tasks.shard_mean(task, model)
    (loss * (1 if mean else layout.dp)).backward()
    clip(list(model.parameters()), MAX_NORM)
    optimizer.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    shards = layout.world // layout.dp * (layout.dp if mean else 1)
    return StepRecord(total / shards, whole_params(model))


def _trainer_refusal(model, folder: str) -> str:
    """What transformers' Trainer says to checkpointing this model's optimizer (save_strategy='steps')."""
    from transformers import Trainer, TrainingArguments

    try:
        Trainer(model=model, args=TrainingArguments(output_dir=folder, save_strategy="steps", report_to="none"))
    except ValueError as exc:
        # Its own rule (trainer.py: "Resuming is not supported for models sharded at load time") comes after
        # accelerate's checks, which on CPU refuse a DistributedConfig model first: whichever speaks, in its words.
        return f"(e) transformers' Trainer(save_strategy='steps') refuses this model: {exc}"
    return "(e) transformers' Trainer(save_strategy='steps') accepts this model"


#: How long the ranks that raised in a part wait for the rest before taking the raise as theirs alone: ranks that
#: raise the same library error do so within seconds of each other.
AGREE_SECONDS = 30.0


_AGREEMENT: dict = {}


def agreement_group():
    """A plain gloo group over the world, made once per world (on every rank at once, as group making is a
    collective): `monitored_barrier` takes no other, and the kit's gloo worlds name their device ("cpu:gloo").
    None where the world is no gloo one."""
    world = dist.group.WORLD
    if world not in _AGREEMENT:
        _AGREEMENT.clear()  # a world made anew in this process: the old one's group went with it
        _AGREEMENT[world] = dist.new_group(backend="gloo") if "gloo" in str(dist.get_backend()) else None
    return _AGREEMENT[world]


def peers_raised_too(part: str, seconds: float = AGREE_SECONDS) -> bool:
    """After this rank raised in a part (a refusal too): whether every rank reached this point (each raised in it),
    within `seconds`. Where only some ranks raise (MiniCPM5-MoE's reload on tp2xfsdp2xep2: three ranks' loads
    raised, which the kit reads as transformers refusing the layout, while the fourth was still making its unit
    mesh, a collective), going on to the next part's barrier hangs on that peer; False then, and the part's raise
    ends the case. Only gloo has a barrier that gives up (`monitored_barrier`);
    elsewhere (no `agreement_group`) every rank is taken to have raised, as before."""
    group = _AGREEMENT.get(dist.group.WORLD)
    if group is None:
        return True
    try:
        dist.monitored_barrier(group, timeout=datetime.timedelta(seconds=seconds))
    except RuntimeError:  # a peer did not come: it is elsewhere, inside a collective this rank left
        return False
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, part, group=group)  # each raised in the same part, or they walk apart from here
    return len(set(parts)) == 1


# -- folders and files ----------------------------------------------------------------------------------------


def _agreed(workdir: str) -> str:
    """Rank 0's workdir: the folder every rank reads and writes (a torchrun rank's own workdir differs)."""
    chosen = [os.path.abspath(workdir)]
    dist.broadcast_object_list(chosen, src=0)
    return chosen[0]


@contextlib.contextmanager
def _folder(root: str, name: str):
    """A new folder for one part; removed by rank 0 once every rank is done with it, or by each rank at once when
    the part raises (its peers may never reach a barrier)."""
    path = os.path.join(root, f"checkpoint-{name}")
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
    dist.barrier()
    try:
        yield path
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _planted(plant, *args):
    with plant(*args) if plant else contextlib.nullcontext():
        yield


def _names_and_shapes(saved: str, single: str) -> list[str]:
    """How the safetensors in `saved` differ, by tensor name and shape, from the single-device checkpoint's."""
    mine, theirs = _header(saved), _header(single)
    problems = []
    missing, extra = sorted(set(theirs) - set(mine)), sorted(set(mine) - set(theirs))
    if missing:
        problems.append(f"the safetensors lack {len(missing)} of the single-device model's {len(theirs)} tensors "
                        f"({_few(missing)})")
    if extra:
        problems.append(f"the safetensors hold {len(extra)} names the single-device model lacks ({_few(extra)})")
    shapes = [f"{n} {list(mine[n])} != {list(theirs[n])}" for n in sorted(set(mine) & set(theirs))
              if mine[n] != theirs[n]]
    if shapes:
        problems.append(f"{len(shapes)} safetensors shape(s) differ from the single-device model's: {_few(shapes)}")
    return problems


def _header(folder: str) -> dict:
    from safetensors import safe_open

    found = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), "pt") as handle:
                found.update({key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()})
    return found


def _few(names: list, count: int = 3) -> str:
    return ", ".join(names[:count]) + (f", ... ({len(names) - count} more)" if len(names) > count else "")

