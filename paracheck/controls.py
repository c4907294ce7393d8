"""Negative controls: known bugs a route plants on purpose, each naming the checks that must catch it.

A control proves a check can fail. Each one is planted by the route on the model it just
parallelized (never by patching diffusers globally), so the rest of the run is untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .layout import Layout

FORWARD = "parity.forward"
GRADS = "parity.grads"
MESH = "structure.mesh"
HOOKS = "structure.cp_hooks"
PROCS = "structure.processor_config"
SHARDS = "structure.tp_shards"


@dataclass(frozen=True)
class Control:
    name: str
    plants: str
    must_trip: tuple[str, ...]
    applies: Callable[[Layout], str | None]
    #: Routes that can plant it; None for every route.
    routes: tuple[str, ...] | None = None

    def skip_reason(self, layout: Layout, route: str | None = None) -> str | None:
        """Why this control cannot run on `layout` (and `route`, once resolved); None when it can."""
        reason = self.applies(layout)
        if reason is None and route is not None and self.routes and route not in self.routes:
            reason = f"{self.name} is planted by the {'/'.join(self.routes)} route, not {route}"
        return reason


def _needs_cp(layout: Layout) -> str | None:
    return None if layout.has_cp else f"layout {layout} has no context parallelism to break"


def _needs_tp_alone(layout: Layout) -> str | None:
    return None if layout.has_tp and not layout.has_cp else f"layout {layout} is not tensor parallelism alone"


def _global_index_differs(layout: Layout) -> str | None:
    if not layout.has_tp:
        return f"layout {layout} has no tensor parallelism"
    if all(r % layout.tp == layout.coords(r)["tp"] for r in range(layout.world)):
        return (
            f"on {layout} ({layout.order}) every rank's global rank mod tp equals its TP-mesh coordinate, "
            "so the bug cannot show"
        )
    return None


def _needs_tp_and_cp(layout: Layout) -> str | None:
    return None if layout.has_tp and layout.has_cp else f"layout {layout} has one kind of parallelism; order is moot"


def _always(layout: Layout) -> str | None:
    return None


CONTROLS: dict[str, Control] = {
    c.name: c
    for c in (
        Control("skip-cp-hooks", "CP requested; hooks never registered, processors not told", (HOOKS, PROCS), _needs_cp),
        Control("skip-processor-config", "hooks registered; attention processors not given the config", (PROCS, FORWARD), _needs_cp),
        Control("skip-output-gather", "the cp_output hook left out", (HOOKS, FORWARD), _needs_cp),
        Control("global-rank-shard-index", "TP shards picked by global rank (mod tp) instead of TP-mesh coordinate", (SHARDS, FORWARD), _global_index_differs),
        Control("tp-processor-config", "TP alone, yet processors handed the parallel config", (PROCS,), _needs_tp_alone),
        Control("backward-only", "first Linear's output gradient scaled by 1.5; forward bit-identical", (GRADS,), _always),
        Control("swapped-mesh-order", "shared mesh built in the order the layout did not ask for", (MESH,), _needs_tp_and_cp,
                routes=("composed",)),
    )
}


def applicable(layout: Layout) -> list[str]:
    """The controls that can be planted on `layout` (by some route)."""
    return [name for name, control in CONTROLS.items() if control.applies(layout) is None]


def get_control(name: str) -> Control:
    if name not in CONTROLS:
        raise ValueError(f"control {name!r}: must be one of {', '.join(CONTROLS)}")
    return CONTROLS[name]


# -- planting ---------------------------------------------------------------------------------
# Each planter runs after the route applied parallelism correctly and undoes or bends one piece.


def plant(name: str, model, applied, reference_state: dict) -> None:
    planter = _PLANTERS.get(name)
    if planter is not None:
        planter(model, applied, reference_state)


def _remove_cp_hooks(model, kinds: tuple[str, ...]) -> None:
    for module in model.modules():
        registry = getattr(module, "_diffusers_hook", None)
        if registry is None:
            continue
        for hook_name in list(registry.hooks):
            if hook_name.startswith(kinds):
                registry.remove_hook(hook_name)


def _set_processor_config(model, config) -> None:
    from .checks import attention_processors

    for _, processor in attention_processors(model):
        processor._parallel_config = config


def _skip_cp_hooks(model, applied, _):
    _remove_cp_hooks(model, ("cp_input---", "cp_output---"))
    _set_processor_config(model, None)


def _skip_processor_config(model, applied, _):
    _set_processor_config(model, None)


def _skip_output_gather(model, applied, _):
    _remove_cp_hooks(model, ("cp_output---",))


def _tp_processor_config(model, applied, _):
    _set_processor_config(model, applied.parallel_config)


def _global_rank_shard_index(model, applied, reference_state):
    from .checks import local_slice, tp_specs

    wrong_index = applied.rank % applied.layout.tp
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, spec in tp_specs(model, applied.layout.tp).items():
            if spec.dim is None:
                continue
            local = params[name].to_local()
            local.copy_(local_slice(reference_state[name], spec, wrong_index, applied.layout.tp))


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.5


def _backward_only(model, applied, _):
    first_linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    first_linear.register_forward_hook(lambda module, args, output: _ScaleGrad.apply(output))


_PLANTERS = {
    "skip-cp-hooks": _skip_cp_hooks,
    "skip-processor-config": _skip_processor_config,
    "skip-output-gather": _skip_output_gather,
    "tp-processor-config": _tp_processor_config,
    "global-rank-shard-index": _global_rank_shard_index,
    "backward-only": _backward_only,
    # swapped-mesh-order is planted while the composed route builds its mesh.
}
