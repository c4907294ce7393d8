"""The diffusers adapter's negative controls: each known bug, how and when it is planted, where it applies,
what must catch it (`adapters.get_control` finds every adapter's by name).

A control proves a check can fail. It is planted on the one model a case just parallelized (never by
patching diffusers globally), so the rest of the run is untouched. Everything about a control lives in
its `Control` entry (`control.py` says what one is); no other module names one. Torch is imported only inside the planters.
"""

from __future__ import annotations

from paracheck.adapters.diffusers import library
from paracheck.domain.control import Control, applicable_to
from paracheck.domain.layout import Layout
from paracheck.domain.records import CheckId, Route

# -- where each control can show -------------------------------------------------------------------


def _needs_cp(layout: Layout) -> str | None:
    return None if layout.has_cp else f"layout {layout} has no context parallelism to break"


def _needs_tp_alone(layout: Layout) -> str | None:
    return None if layout.has_tp and not layout.has_cp else f"layout {layout} is not tensor parallelism alone"


def _global_index_differs(layout: Layout) -> str | None:
    if not layout.has_tp:
        return f"layout {layout} has no tensor parallelism"
    if all(r % layout.tp == layout.coords(r)["tp"] for r in range(layout.world)):
        return (f"on {layout} ({layout.order}) every rank's global rank mod tp equals its TP-mesh coordinate, "
                "so the bug cannot show")
    return None


def collapsed_cp_tp_index(layout: Layout, rank: int) -> int:
    """The TP coordinate `cp-collapsed-shard-index` reads off `rank`: unflattened over the mesh with its two CP
    dimensions taken as one, of the ring degree (Ulysses's when there is no ring), as code written when ring and
    Ulysses did not compose would. Where ring or Ulysses is 1, that one dimension *is* the CP group, so the
    mesh is the layout's own (less a dimension of 1) and the coordinate is the TP one on every rank; only
    tp, ring and ulysses all above 1 (and TP not the fastest dimension) can tell them apart."""
    collapsed = layout.ring if layout.ring > 1 else layout.ulysses
    shape = [(dim, layout.tp if dim == "tp" else collapsed) for dim in layout.mesh_dims if dim != "ulysses"]
    coords = {}
    for dim, size in reversed(shape):
        coords[dim], rank = rank % size, rank // size
    return coords["tp"]


def _collapsed_index_differs(layout: Layout) -> str | None:
    if not layout.has_tp:
        return f"layout {layout} has no tensor parallelism"
    if all(collapsed_cp_tp_index(layout, r) == layout.coords(r)["tp"] for r in range(layout.world)):
        return (f"on {layout} ({layout.order}) the TP coordinate read over one CP dimension is the mesh's on every "
                "rank (it takes tp, ring and ulysses all above 1, TP not the fastest), so the bug cannot show")
    return None


def _needs_tp_and_cp(layout: Layout) -> str | None:
    return None if layout.has_tp and layout.has_cp else f"layout {layout} has one kind of parallelism; order is moot"


def _needs_ring(layout: Layout) -> str | None:
    return None if layout.ring > 1 else f"layout {layout} has no ring attention"


def _always(layout: Layout) -> str | None:
    return None


def _needs_tp(layout: Layout) -> str | None:
    # Under CP alone every gradient is whole on every rank once summed over the CP group: no local norm differs.
    return None if layout.has_tp else f"layout {layout} has no tensor parallelism: no rank holds a shard of a gradient"


# -- what each control plants ------------------------------------------------------------------------


def _skip_cp_hooks(model, applied, _):
    library.remove_hooks(model, (library.CP_INPUT, library.CP_OUTPUT))
    library.set_processor_config(model, None)


def _skip_processor_config(model, applied, _):
    library.set_processor_config(model, None)


def _skip_output_gather(model, applied, _):
    library.remove_hooks(model, (library.CP_OUTPUT,))


def _tp_processor_config(model, applied, _):
    library.set_processor_config(model, applied.parallel_config)


def _global_rank_shard_index(model, applied, reference_state):
    _reslice(model, applied, reference_state, applied.rank % applied.layout.tp)


def _collapsed_cp_shard_index(model, applied, reference_state):
    _reslice(model, applied, reference_state, collapsed_cp_tp_index(applied.layout, applied.rank))


def _reslice(model, applied, reference_state, wrong_index: int):
    """Every TP-sharded parameter's local tensor overwritten with shard `wrong_index` of the reference's (where
    the wrong index is this rank's TP coordinate, the very shard the route put there: a no-op). Without TP no
    parameter is sharded (they are plain tensors, not DTensors), so there is nothing to re-slice."""
    import torch

    if applied.layout.tp == 1:
        return

    from paracheck.checks.shards import local_slice

    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, spec in library.tp_shard_specs(model, applied.layout.tp).items():
            if spec.dim is not None:
                local = params[name].to_local()
                local.copy_(local_slice(reference_state[name], spec, wrong_index, applied.layout.tp))


def _backward_only(model, applied, _):
    import torch

    class ScaleGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return grad * 1.5

    # At the model's output, so every gradient scales and the bug stands out of bf16 noise on every
    # model (a first or last Linear can feed a single noisy gradient, or an output that is not checked).
    def scale_first_output(module, args, output):
        if isinstance(output, tuple):
            return (ScaleGrad.apply(output[0]),) + tuple(output[1:])
        output.sample = ScaleGrad.apply(output.sample)
        return output

    model.register_forward_hook(scale_first_output)


def _other_order(order: str) -> str:
    return "tp-fastest" if order == "cp-fastest" else "cp-fastest"


def _numbers_stayed_right(failing: set) -> str:
    return "" if CheckId.FORWARD in failing else "the numbers stayed right: only the structure checks see this bug"


def _training_pass_right(failing: set) -> str:
    return "" if CheckId.FORWARD in failing else "the training forward stayed right: only the no-grad pass shows it"


# -- where each control plants (`Control.plants_in`: globs over module names, matched by `planted_at`) -----
# The names the bundled models give these places; a localization of a detected case must name one.

#: The model itself: its output's gradient, or the CP split of its inputs at the root.
ROOT = "<root>"
#: An attention module: a fault in the backend (or a processor left without the config) acts on every call
#: dispatched context-parallel, and the first the forward (or the backward) reaches names it: a block's
#: self-attention (`attn`, `attn1` on Wan and ChronoEdit), or LTX's cross-attention (`attn2`), whose text the
#: plan splits too and which the backward reaches first.
SELF_ATTENTION = "*.attn|*.attn1|*.attn2"
#: The `_cp_plan`'s first output gather point: `proj_out` on every bundled model but Helios, which gathers
#: after each block's attention (`blocks.0.attn1` first).
GATHER_POINT = "proj_out|*.attn1"
#: The first TP-planned module in execution order (every planned parameter is re-sliced; the first block's
#: query projection is the first of them a forward reaches on Flux, Flux2 and QwenImage).
FIRST_TP_MODULE = "*.attn.to_q|*.attn.to_qkv_mlp_proj"

def _clip_local_norm():
    from paracheck.checks import trainloop

    return trainloop.Hooks(clip=trainloop.clip_local_norm)


def _decay_twice():
    from paracheck.checks import trainloop

    return trainloop.Hooks(after_step=trainloop.decay_replicated_again)


CONTROLS: dict[str, Control] = {c.name: c for c in (
    Control("skip-cp-hooks", "CP requested; hooks never registered, processors not told",
            (CheckId.CP_HOOKS, CheckId.PROCESSOR_CONFIG), _needs_cp, _skip_cp_hooks, note=_numbers_stayed_right,
            plants_in=ROOT),
    Control("skip-processor-config", "hooks registered; attention processors not given the config",
            (CheckId.PROCESSOR_CONFIG, CheckId.COLLECTIVES, CheckId.FORWARD), _needs_cp, _skip_processor_config,
            plants_in=SELF_ATTENTION),
    Control("skip-output-gather", "the cp_output hook left out",
            (CheckId.CP_HOOKS, CheckId.FORWARD), _needs_cp, _skip_output_gather, plants_in=GATHER_POINT),
    Control("global-rank-shard-index", "TP shards picked by global rank (mod tp) instead of TP-mesh coordinate",
            (CheckId.TP_SHARDS, CheckId.FORWARD), _global_index_differs, _global_rank_shard_index,
            plants_in=FIRST_TP_MODULE, per_rank=True),
    Control("cp-collapsed-shard-index", "TP shards picked by a TP coordinate read off the global rank over a mesh "
            "with one CP dimension (ring, or Ulysses without ring), as code from before ring and Ulysses composed; "
            "right on every mesh with at most two dimensions above 1", (CheckId.TP_SHARDS, CheckId.FORWARD),
            _collapsed_index_differs, _collapsed_cp_shard_index, plants_in=FIRST_TP_MODULE, per_rank=True),
    Control("tp-processor-config", "TP alone, yet processors handed the parallel config",
            (CheckId.PROCESSOR_CONFIG,), _needs_tp_alone, _tp_processor_config),
    Control("backward-only", "the model output's gradient scaled by 1.5 on the way back; forward bit-identical",
            (CheckId.GRADS,), _always, _backward_only, plants_in=ROOT),
    Control("swapped-mesh-order", "shared mesh built in the order the layout did not ask for",
            (CheckId.MESH,), _needs_tp_and_cp, mesh_order=_other_order, routes=(Route.COMPOSED,)),
    Control("ring-stale-kv-backward", "ring backward reuses the local KV chunk at every step (diffusers #14265's "
            "shape); forward exact", (CheckId.GRADS,), _needs_ring, attention_fault="stale-kv-backward",
            plants_in=SELF_ATTENTION),
    Control("ring-drop-merge", "ring forward drops the visiting KV chunks' partial results (no LSE merge)",
            (CheckId.FORWARD,), _needs_ring, attention_fault="drop-ring-merge", plants_in=SELF_ATTENTION),
    Control("cp-attention-local", "the attention backend ignores the CP config it is handed and attends this "
            "rank's own shard: no all-to-all, no KV gather, no error", (CheckId.COLLECTIVES, CheckId.FORWARD),
            _needs_cp, attention_fault="ignore-cp-config", plants_in=SELF_ATTENTION),
    Control("inference-attention-local", "only when no gradient is recorded (how pipelines call a model), the "
            "attention backend ignores the CP config and attends this rank's own shard; the training pass is "
            "exact", (CheckId.INFERENCE, CheckId.COLLECTIVES), _needs_cp, attention_fault="ignore-cp-config-no-grad",
            note=_training_pass_right, plants_in=SELF_ATTENTION),
    Control("clip-local-norm", "parity.steps' gradient clip takes its norm over this rank's own shards only, so each "
            "TP rank scales its gradients by a factor of its own; every pass before the steps exact",
            (CheckId.STEPS,), _needs_tp),
    Control("decay-twice", "AdamW's weight decay applied a second time, after each step, to every parameter "
            "replicated on every rank (outside the _tp_plan, or all of them under CP); every pass before the steps "
            "exact", (CheckId.STEPS,), _always),
)}

#: control name -> what it plants in parity.steps' optimizer loop: a builder of the loop's hooks
#: (`checks.trainloop.Hooks`), called on the rank (torch is imported there).
_STEP_HOOKS = {"clip-local-norm": _clip_local_norm, "decay-twice": _decay_twice}


def per_rank_refusal(control: Control) -> str | None:
    """Why `control` cannot be planted once per rank (`Control.per_rank`): only its planter, which `routes.apply`
    runs after the route, is; a bug planted in the attention backend, the mesh order or the optimizer loop is not."""
    if control.planter is None or control.name in _STEP_HOOKS:
        return (f"{control.name} is planted in the attention backend, the mesh order or parity.steps' optimizer loop, "
                "not by a planter the adapter can run once per rank")
    return None


def step_hooks(name: str | None):
    """The optimizer loop's hooks for a case with control `name` (the plain loop's for any other)."""
    from paracheck.checks import trainloop

    builder = _STEP_HOOKS.get(name)
    return builder() if builder else trainloop.PLAIN


def applicable(layout: Layout) -> list[str]:
    """The controls that can be planted on `layout` (by some route)."""
    return applicable_to(CONTROLS, layout)


