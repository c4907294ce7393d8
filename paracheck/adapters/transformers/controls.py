"""Negative controls for the transformers adapter: each planted bug, where it applies, what must catch it.

They are the kit's `Control` records (judged by `Control.judge`, like the diffusers ones); how each is
planted lives in `PLANTS`, read by `rank`. A bug is planted the way a user or a release could make it: a plan
override passed in `DistributedConfig`, a data-parallel switch left off, a wrong loss factor. No module
outside this one names these controls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from paracheck.domain.control import Control, applicable_to
from paracheck.domain.records import CheckId


@dataclass(frozen=True)
class Plant:
    #: Rules merged into `DistributedConfig(tp_plan=...)`, keys with the full `model.` prefix.
    tp_plan: dict = field(default_factory=dict)
    #: Plan keys the model's own tp_plan must have for the bug to exist (else the case is skipped).
    needs_rules: tuple = ()
    #: (model, layout) -> None, after `from_pretrained` built the parallel model.
    after_load: Callable | None = None
    #: The factor the local loss is multiplied by before backward, given the layout's dp. The right one is dp
    #: itself (FSDP2 averages gradients over the dp ranks; each local loss is a share of the global mean).
    loss_factor: Callable[[int], float] = float
    #: single-process model -> why the bug cannot exist in it (the case is then skipped), else None.
    needs_model: Callable | None = None
    #: single-process model -> more rules for `tp_plan`, read from its modules (for plans whose keys differ
    #: from family to family).
    tp_plan_from: Callable | None = None
    #: () -> the `Trainer` subclass parity.steps trains the parallel model with (None: transformers' own `Trainer`).
    trainer_plant: Callable | None = None

    def bound(self, ref) -> "Plant":
        """This plant with the rules `tp_plan_from` reads from the single-process model merged in."""
        if self.tp_plan_from is None:
            return self
        import dataclasses

        return dataclasses.replace(self, tp_plan={**self.tp_plan, **self.tp_plan_from(ref)}, tp_plan_from=None)


def _needs_tp(layout) -> str | None:
    return None if layout.tp > 1 else f"layout {layout} has no tensor parallelism"


def _needs_tp_without_ep(layout) -> str | None:
    """TP where no expert plan takes over the experts' rules (under EP the experts' packed rule is not used)."""
    if layout.ep > 1:
        return f"layout {layout} runs the experts expert-parallel, so their tp rules do not apply"
    return _needs_tp(layout)


def _needs_dp(layout) -> str | None:
    return None if layout.dp > 1 and layout.pp == 1 else f"layout {layout} has no data parallelism"


def _skip_dp_reduce(model, layout) -> None:
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            # HSDP: the replicas' all-reduce left out; FSDP alone: gradient sync left off after accumulation.
            if layout.dpr > 1:
                module.set_requires_all_reduce(False)
            else:
                module.set_requires_gradient_sync(False)


def _rowwise_with_bias(model) -> list:
    """The modules transformers runs row-parallel that hold a bias (gpt_neox's dense, phi's fc2, ...)."""
    from paracheck.adapters.transformers.structure import style_of

    plan = dict(getattr(model, "tp_plan", None) or {})
    return [m for name, m in model.named_modules()
            if (style_of(name, plan, False) or "").startswith("rowwise") and getattr(m, "bias", None) is not None]


def _bias_before_reduce(model, layout) -> None:
    """Each rank adds its row-parallel bias to its partial sum, so the all-reduce counts it tp times: the same
    output as adding (tp - 1) more copies after transformers' own reduction, which is how it is planted. The
    row-parallel modules of the loaded model are those whose weight is split on tp by input rows."""
    for module in model.modules():
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        if bias is None or not hasattr(weight, "placements") or "tp" not in (weight.device_mesh.mesh_dim_names or ()):
            continue
        placement = weight.placements[weight.device_mesh.mesh_dim_names.index("tp")]
        if getattr(placement, "dim", None) in (1, -1) and weight.ndim == 2:
            module.register_forward_hook(lambda m, args, out, extra=layout.tp - 1: out + extra * _local(m.bias))


def _packed_as_colwise(ref) -> dict:
    """Every packed (fused gate and up) rule planned plain colwise: the fused weight split in one run of rows,
    so one rank holds the gate halves and another the up halves, instead of each rank a slice of both."""
    return {k: "colwise" for k, v in dict(getattr(ref, "tp_plan", None) or {}).items() if v == "packed_colwise"}


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


_NORMS = ("model.layers.*.self_attn.q_norm", "model.layers.*.self_attn.k_norm")

_ENTRIES = (
    (Control("tf-norm-replicate", "Qwen3's per-head q_norm/k_norm planned replicate instead of "
             "replicated_with_grad_allreduce: each TP rank keeps its heads' share of their gradient",
             (CheckId.GRADS,), _needs_tp, plants_in="*.q_norm.weight|*.k_norm.weight"),
     Plant(tp_plan=dict.fromkeys(_NORMS, "replicate"), needs_rules=_NORMS)),
    (Control("tf-skip-dp-reduce", "data-parallel gradient reduction left off (HSDP: the replicas' all-reduce; "
             "FSDP: gradient sync)", (CheckId.GRADS,), _needs_dp, plants_in="<root>"),
     Plant(after_load=_skip_dp_reduce)),
    (Control("tf-grad-divide", "the local loss not scaled by the data-parallel degree before backward, while "
             "FSDP averages gradients over it: every gradient dp times too small, loss exact",
             (CheckId.GRADS,), _needs_dp, plants_in="<root>"),
     Plant(loss_factor=lambda dp: 1.0)),
    (Control("tf-embed-replicate", "the input embedding planned replicate instead of embedding_rowwise: numbers "
             "exact, the vocabulary no longer sharded", (CheckId.TP_SHARDS,), _needs_tp),
     Plant(tp_plan={"model.embed_tokens": "replicate"}, needs_rules=("model.embed_tokens",))),
    (Control("tf-rowwise-bias-before-reduce", "a row-parallel bias added on every rank before the reduction, "
             "so the sum counts it tp times (placements exact)", (CheckId.INFERENCE, CheckId.FORWARD),
             _needs_tp),
     Plant(after_load=_bias_before_reduce, needs_model=lambda ref: None if _rowwise_with_bias(ref) else
           "the model has no row-parallel module with a bias")),
    (Control("tf-packed-as-colwise", "a fused gate-and-up projection planned colwise instead of packed_colwise: "
             "split in the wrong order, one rank holds the gates, another the ups (measured on qwen2_moe tp2: the "
             "forward stays exact, the gradients do not)", (CheckId.TP_SHARDS, CheckId.GRADS), _needs_tp_without_ep),
     Plant(tp_plan_from=_packed_as_colwise, needs_model=lambda ref: None if _packed_as_colwise(ref) else
           "the model's tp_plan has no packed_colwise rule")),
)

CONTROLS: dict[str, Control] = {c.name: c for c, _ in _ENTRIES}
PLANTS: dict[str, Plant] = {c.name: p for c, p in _ENTRIES}
NO_PLANT = Plant()


def applicable(layout) -> list[str]:
    return applicable_to(CONTROLS, layout)
