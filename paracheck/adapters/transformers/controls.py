"""Negative controls for the transformers adapter: each planted bug, where it applies, what must catch it.

They are the kit's `Control` records (judged by `Control.judge`, like the diffusers ones); how each is
planted lives in `PLANTS`, read by `rank`. A bug is planted the way a user or a release could make it: a plan
override passed in `DistributedConfig`, a data-parallel switch left off, a wrong loss factor. No module
outside this one names these controls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from paracheck.domain.control import Control
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


def _needs_tp(layout) -> str | None:
    return None if layout.tp > 1 else f"layout {layout} has no tensor parallelism"


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
)

CONTROLS: dict[str, Control] = {c.name: c for c, _ in _ENTRIES}
PLANTS: dict[str, Plant] = {c.name: p for c, p in _ENTRIES}
NO_PLANT = Plant()


def applicable(layout) -> list[str]:
    return [name for name, control in CONTROLS.items() if control.applies(layout) is None]
