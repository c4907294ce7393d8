"""Fitting a model to a layout: head counts that tp x ulysses divides, and inputs the CP degree splits.

Pure apart from reading the model class's plans: no process group, no weights. The proof that a fit
works is the reference run the worker makes on one device before any parallel code runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .layout import Layout, fit_heads

HEADS_KEY = "num_attention_heads"
HEAD_DIM_KEY = "attention_head_dim"

#: Config keys a model requires to equal heads x head_dim. Raising the heads alone breaks these with a
#: shape error (measured on LTX: its cross-attention projects to `cross_attention_dim`).
TIED_TO_INNER_DIM: dict[str, tuple[str, ...]] = {
    "LTXVideoTransformer3DModel": ("cross_attention_dim",),
}


class Unfittable(Exception):
    """The model cannot take the layout; the message says why, for the report's skip reason.
    `never` marks a model without any plan for that kind of parallelism."""

    def __init__(self, message: str, never: bool = False):
        super().__init__(message)
        self.never = never


@dataclass
class Fit:
    init_dict: dict
    changes: list[str] = field(default_factory=list)


def fit_init_dict(model_class: type, init_dict: dict, layout: Layout) -> Fit:
    """A copy of `init_dict` whose heads (and what is tied to them) suit `layout`."""
    name = model_class.__name__
    if layout.has_tp and not getattr(model_class, "_tp_plan", None):
        raise Unfittable(f"{name} has no _tp_plan, so it cannot take tensor parallelism (layout {layout})", never=True)
    if layout.has_cp and not getattr(model_class, "_cp_plan", None):
        raise Unfittable(f"{name} has no _cp_plan, so it cannot take context parallelism (layout {layout})", never=True)
    fitted = dict(init_dict)
    changes: list[str] = []
    if layout.head_multiple == 1:
        return Fit(fitted, changes)
    heads = fitted.get(HEADS_KEY, _default(model_class, HEADS_KEY))
    if not isinstance(heads, int):
        raise Unfittable(f"{name}: no integer {HEADS_KEY} to fit to tp x ulysses = {layout.head_multiple}")
    new_heads = fit_heads(heads, layout)
    if new_heads == heads:
        return Fit(fitted, changes)
    fitted[HEADS_KEY] = new_heads
    changes.append(f"{HEADS_KEY} {heads}->{new_heads}")
    head_dim = fitted.get(HEAD_DIM_KEY, _default(model_class, HEAD_DIM_KEY))
    for key in TIED_TO_INNER_DIM.get(name, ()):
        if not isinstance(head_dim, int):
            raise Unfittable(f"{name}: {key} is tied to heads x {HEAD_DIM_KEY}, but {HEAD_DIM_KEY} is unknown")
        old = fitted.get(key, _default(model_class, key))
        fitted[key] = new_heads * head_dim
        changes.append(f"{key} {old}->{fitted[key]}")
    return Fit(fitted, changes)


def cp_split_problems(model_class: type, inputs: dict, layout: Layout) -> list[str]:
    """Top-level inputs the `_cp_plan` splits whose split dimension the CP degree does not divide."""
    if not layout.has_cp:
        return []
    plan = (getattr(model_class, "_cp_plan", None) or {}).get("", {})
    problems = []
    if not isinstance(plan, dict):
        return problems
    for key, spec in plan.items():
        value = inputs.get(key) if isinstance(key, str) else None
        if value is None or not hasattr(value, "shape") or getattr(spec, "split_output", False):
            continue
        expected = getattr(spec, "expected_dims", None)
        if expected is not None and value.dim() != expected:
            continue  # diffusers leaves it unsplit; the worker reports that as a finding
        size = value.shape[spec.split_dim]
        if size % layout.cp:
            problems.append(
                f"input {key!r} dim {spec.split_dim} has size {size}, which the CP degree {layout.cp} "
                f"(ring {layout.ring} x ulysses {layout.ulysses}) does not divide"
            )
    return problems


def _default(model_class: type, key: str):
    import inspect

    try:
        parameter = inspect.signature(model_class.__init__).parameters.get(key)
    except (TypeError, ValueError):
        return None
    return None if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default
