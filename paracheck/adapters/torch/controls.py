"""Negative controls for the torch adapter: bugs planted in a correctly parallelized user module, and the checks
that must catch each. How each is planted lives in `PLANTS` (model, mesh, layout -> what was planted in), run
right after the spec's own parallelize. No module outside this one names these controls.
"""

from __future__ import annotations

from typing import Callable

from paracheck.domain.adapter import Refused
from paracheck.domain.control import PLANTED, Control, applicable_to
from paracheck.domain.records import CheckId


def _in_a_model(applies):
    """`applies`, on a layout whose ranks hold a model: a pipeline's ranks hold stages and a schedule, whose own
    control is `torch-pp-unscaled`."""
    def check(layout) -> str | None:
        if layout.pp > 1:
            return f"layout {layout} pipelines: its ranks hold stages, not a model to plant in"
        return applies(layout)
    return check


@_in_a_model
def _needs_tp(layout) -> str | None:
    return None if layout.tp > 1 else f"layout {layout} has no tensor parallelism"


@_in_a_model
def _needs_dp(layout) -> str | None:
    return None if layout.dp_degree > 1 else f"layout {layout} has no data parallelism"


def _needs_pp(layout) -> str | None:
    return None if layout.pp > 1 else f"layout {layout} has no pipeline"


def _tp_sharded(model, mesh):
    """The first parameter (in `named_parameters` order, the same on every rank) sharded on the `tp` dimension."""
    from torch.distributed.tensor import DTensor

    from paracheck.adapters.torch import names

    for name, param in names.parameters(model).items():  # by the name the checks and localization give it
        if isinstance(param, DTensor) and "tp" in (param.device_mesh.mesh_dim_names or ()):
            index = param.device_mesh.mesh_dim_names.index("tp")
            if param.placements[index].is_shard():
                return name, param
    raise Refused("no parameter is sharded on the tp dimension: nothing to swap")


def _swap_tp_shard(model, mesh, layout, spec) -> str:
    """Rank t of each TP group takes rank t+1's local shard of one parameter: a plan that numbers TP ranks
    in another order than the mesh does."""
    import torch
    import torch.distributed as dist

    name, param = _tp_sharded(model, mesh)
    local = param._local_tensor  # the shard itself (FSDP2 keeps it a view of its sharded storage)
    group = mesh.get_group("tp")
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local.detach().contiguous(), group=group)
    mine = dist.get_group_rank(group, dist.get_rank())
    with torch.no_grad():
        local.copy_(pieces[(mine + 1) % len(pieces)])
    return name


def _fsdp_modules(model):
    from torch.distributed.fsdp import FSDPModule

    found = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not found:
        raise Refused("the spec's parallelize calls no fully_shard: no data-parallel reduction to leave off")
    return found


def _skip_dp_reduce(model, mesh, layout, spec) -> str:
    """The data-parallel gradient reduction left off: HSDP's replica all-reduce, or FSDP's gradient sync."""
    modules = _fsdp_modules(model)
    for module in modules:
        if layout.dp > 1 and layout.fsdp > 1:
            module.set_requires_all_reduce(False)
        else:
            module.set_requires_gradient_sync(False)
    return type(modules[-1]).__name__


def _sum_not_mean(model, mesh, layout, spec) -> str:
    """Gradients summed over the data-parallel ranks instead of averaged (a divide factor of 1)."""
    if spec.grad_reduction == "sum":
        raise Refused("the spec's plan already sums gradients over the data-parallel ranks (grad_reduction)")
    modules = _fsdp_modules(model)
    for module in modules:
        module.set_force_sum_reduction_for_comms(True)  # scaled apart from the collective: gloo has no PREMUL_SUM
        module.set_gradient_divide_factor(1.0)
    return type(modules[-1]).__name__


@_in_a_model
def _has_shards(layout) -> str | None:
    return None if layout.tp > 1 or layout.dp_degree > 1 else f"layout {layout} shards no gradient"


@_in_a_model
def _no_dp(layout) -> str | None:
    return None if layout.dp_degree == 1 else (f"layout {layout} shards every parameter over its data-parallel ranks "
                                               "(fully_shard), so none is replicated on every rank")


def _unscaled(pipe, mesh, layout, spec) -> str:
    """The schedule's gradients left unscaled: each microbatch's loss is a mean over it, so the sum over the
    microbatches the backward accumulates is n_microbatches times the batch mean's gradient."""
    pipe.schedule.scale_grads = False
    return type(pipe.schedule).__name__


def _in_the_loop(model, mesh, layout, spec) -> str:
    """A bug of parity.steps' optimizer loop: nothing to plant in the model (`step_hooks` plants it)."""
    return "parity.steps' optimizer loop"


def _clip_local_norm():
    from paracheck.checks import trainloop

    return trainloop.Hooks(clip=trainloop.clip_local_norm)


def _decay_twice():
    from paracheck.checks import trainloop

    return trainloop.Hooks(after_step=trainloop.decay_replicated_again)


_ENTRIES = (
    (Control("torch-shard-swap", "one tensor-parallel parameter's local shard taken from the next TP rank (the "
             "first parameter sharded on tp): every rank holds a shard, none the one its coordinate names",
             (CheckId.TP_SHARDS, CheckId.FORWARD), _needs_tp, plants_in=PLANTED, per_rank=True), _swap_tp_shard),
    (Control("torch-skip-dp-reduce", "data-parallel gradient reduction left off (HSDP: the replicas' all-reduce; "
             "FSDP: gradient sync, so no sharded gradient is written)", (CheckId.GRADS,), _needs_dp,
             plants_in="<root>"), _skip_dp_reduce),
    (Control("torch-grad-sum", "FSDP's gradient divide factor set to 1: gradients summed over the data-parallel "
             "ranks, not averaged (dp x fsdp times too large), outputs exact", (CheckId.GRADS,), _needs_dp,
             plants_in="<root>"), _sum_not_mean),
    (Control("torch-clip-local-norm", "parity.steps' gradient clip takes its norm over this rank's own shards only "
             "(DTensor gradients' local tensors), so each rank scales by a factor of its own; every pass before the "
             "steps exact", (CheckId.STEPS,), _has_shards), _in_the_loop),
    (Control("torch-decay-twice", "AdamW's weight decay applied a second time, after each step, to every parameter "
             "replicated on every rank (a plain tensor, or a DTensor replicated on every mesh dimension); every "
             "pass before the steps exact", (CheckId.STEPS,), _no_dp), _in_the_loop),
    (Control("torch-pp-unscaled", "the pipeline schedule's gradients left unscaled (scale_grads=False): every "
             "gradient is the sum of the microbatches' mean-loss gradients, n_microbatches times the batch mean's; "
             "the outputs and the loss exact", (CheckId.GRADS,), _needs_pp, plants_in="<root>"), _unscaled),
)

CONTROLS: dict[str, Control] = {c.name: c for c, _ in _ENTRIES}
#: control name -> planter(model, mesh, layout, spec) -> the parameter or module class it planted in.
PLANTS: dict[str, Callable] = {c.name: p for c, p in _ENTRIES}


def planted_in(name: str, planted: str) -> str | None:
    """The module a control whose place depends on the spec (`plants_in` {planted}) planted in: the module
    holding the parameter its planter names. None for the others (their `plants_in` names the place)."""
    if PLANTED not in (CONTROLS[name].plants_in or ""):
        return None
    return planted.rpartition(".")[0] or "<root>"


#: control name -> what it plants in parity.steps' optimizer loop: a builder of the loop's hooks
#: (`checks.trainloop.Hooks`), called on the rank.
_STEP_HOOKS = {"torch-clip-local-norm": _clip_local_norm, "torch-decay-twice": _decay_twice}


def per_rank_refusal(name: str) -> str | None:
    """Why control `name` cannot be planted once per rank (`Control.per_rank`): its `PLANTS` planter is (the body runs
    it so); a bug planted in parity.steps' optimizer loop (`step_hooks`) is not."""
    if name in _STEP_HOOKS:
        return f"{name} is planted in parity.steps' optimizer loop, not by a planter the adapter can run once per rank"
    return None


def step_hooks(name: str | None):
    """The optimizer loop's hooks for a case with control `name` (the plain loop's for any other)."""
    from paracheck.checks import trainloop

    builder = _STEP_HOOKS.get(name)
    return builder() if builder else trainloop.PLAIN


def applicable(layout) -> list[str]:
    return applicable_to(CONTROLS, layout)
