"""Fitting a model to a layout: head counts that tp x ulysses divides, as many blocks as its plans name,
and inputs the CP degree splits.

Pure apart from reading the model class's plans: no process group, no weights. The proof that a fit
works is the reference run the worker makes on one device before any parallel code runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from paracheck.adapters.diffusers.layout import fit_heads, head_multiple
from paracheck.domain.layout import Layout
from paracheck.domain.records import Failure, FailureKind

HEADS_KEY = "num_attention_heads"
HEAD_DIM_KEY = "attention_head_dim"

#: Config keys a model requires to equal heads x head_dim (where they are set: None leaves the part they size out).
#: Raising the heads alone breaks these with a shape error (measured on LTX: its cross-attention projects to
#: `cross_attention_dim`; on ChronoEdit's image-conditioned pipeline: the image keys and values project from
#: `added_kv_proj_dim`, which Wan's image-to-video configs set to the inner dim as well).
TIED_TO_INNER_DIM: dict[str, tuple[str, ...]] = {
    "LTXVideoTransformer3DModel": ("cross_attention_dim",),
    "LTX2VideoTransformer3DModel": ("cross_attention_dim",),
    "WanTransformer3DModel": ("added_kv_proj_dim",),
    "ChronoEditTransformer3DModel": ("added_kv_proj_dim",),
}

#: Head counts besides `num_attention_heads` whose attentions the CP or TP dispatch also splits by head:
#: class -> ((heads key, head dim key, keys tied to their product), ...). Measured on LTX2: its audio
#: attentions go through the same Ulysses all-to-all with `audio_num_attention_heads`, and its audio
#: cross-attention projects to `audio_cross_attention_dim`. The other eight models with a plan in
#: diffusers 0.42.1 run with raised heads and nothing else changed (tests/adapters/diffusers/test_fitting.py).
OTHER_HEADS: dict[str, tuple[tuple[str, str, tuple[str, ...]], ...]] = {
    "LTX2VideoTransformer3DModel": (
        ("audio_num_attention_heads", "audio_attention_head_dim", ("audio_cross_attention_dim",)),
    ),
}

#: Which init key sets the length of a block list that a plan names by index, as
#: class -> {list path: key}; a list path writes nested indices as `*` (`stages.*.blocks`). A plan names
#: modules, not config keys, so the key cannot be read from the plan; `BLOCK_COUNT_KEYS_DEFAULT` covers
#: the names diffusers' transformers use for their main stacks, a class entry overrides it. Measured on
#: Helios, whose `_cp_plan` names `blocks.0` ... `blocks.39` one by one: with fewer blocks
#: `enable_parallelism` raises "'2' is not a submodule of 'ModuleList'".
BLOCK_COUNT_KEYS_DEFAULT: dict[str, str] = {
    "blocks": "num_layers",
    "transformer_blocks": "num_layers",
    "single_transformer_blocks": "num_single_layers",
}
BLOCK_COUNT_KEYS: dict[str, dict[str, str]] = {
    "HeliosTransformer3DModel": {"blocks": "num_layers"},  # the default too; listed as the measured case
}


class Unfittable(Exception):
    """The model cannot take the layout; the message says why, for the report's skip reason.
    `missing_plan` names the plan attribute a model lacks altogether (it can never take that parallelism)."""

    def __init__(self, message: str, missing_plan: str = ""):
        super().__init__(message)
        self.missing_plan = missing_plan

    @property
    def failure(self) -> Failure:
        return Failure(FailureKind.SKIP, missing_plan=self.missing_plan)


@dataclass
class Fit:
    init_dict: dict
    changes: list[str] = field(default_factory=list)


def fit_init_dict(model_class: type, init_dict: dict, layout: Layout, any_heads: bool = False) -> Fit:
    """A copy of `init_dict` whose heads (and what is tied to them) and block counts suit `layout`.
    `any_heads`: Ulysses takes any head count (the library's ulysses_anything), so only TP must divide them."""
    name = model_class.__name__
    if layout.has_tp and not getattr(model_class, "_tp_plan", None):
        raise Unfittable(f"{name} has no _tp_plan, so it cannot take tensor parallelism (layout {layout})",
                         missing_plan="_tp_plan")
    if layout.has_cp and not getattr(model_class, "_cp_plan", None):
        raise Unfittable(f"{name} has no _cp_plan, so it cannot take context parallelism (layout {layout})",
                         missing_plan="_cp_plan")
    fitted = dict(init_dict)
    changes: list[str] = []
    fit = (lambda h: uneven_heads(h, layout)) if any_heads and layout.ulysses > 1 else \
        (lambda h: fit_heads(h, layout))
    if head_multiple(layout) > 1:
        _fit_head_group(model_class, fitted, fit, HEADS_KEY, HEAD_DIM_KEY, TIED_TO_INNER_DIM.get(name, ()),
                        changes, required=True)
        for heads_key, head_dim_key, tied in OTHER_HEADS.get(name, ()):
            _fit_head_group(model_class, fitted, fit, heads_key, head_dim_key, tied, changes, required=False)
    plans = []
    if layout.has_cp:
        plans.append(("_cp_plan", model_class._cp_plan))
    if layout.has_tp:
        plans.append(("_tp_plan", model_class._tp_plan))
    fitted, block_changes = fit_block_counts(model_class, fitted, plans)
    return Fit(fitted, changes + block_changes)


def uneven_heads(heads: int, layout: Layout) -> int:
    """The smallest head count >= `heads` that TP divides and Ulysses does not, within what the library's
    ulysses_anything takes: it pads each rank to ceil(h / u) heads and asserts the padding is smaller
    than that (diffusers 0.42.1), so 3 heads fit u2 but u4 needs 7."""
    h = max(heads, layout.tp)
    while True:
        per_tp, rem = divmod(h, layout.tp)
        local = -(-per_tp // layout.ulysses)
        pad = layout.ulysses * local - per_tp
        if rem == 0 and 0 < pad < local:
            return h
        h += 1


def _fit_head_group(model_class, fitted: dict, fit, heads_key: str, head_dim_key: str,
                    tied: tuple[str, ...], changes: list[str], required: bool) -> None:
    name = model_class.__name__
    heads = fitted.get(heads_key, _default(model_class, heads_key))
    if not isinstance(heads, int):
        if not required and heads is None and heads_key not in fitted:
            return
        raise Unfittable(f"{name}: no integer {heads_key} to fit to tp x ulysses")
    new_heads = fit(heads)
    if new_heads == heads:
        return
    fitted[heads_key] = new_heads
    changes.append(f"{heads_key} {heads}->{new_heads}")
    head_dim = fitted.get(head_dim_key, _default(model_class, head_dim_key))
    for key in tied:
        if not isinstance(head_dim, int):
            raise Unfittable(f"{name}: {key} is tied to {heads_key} x {head_dim_key}, but {head_dim_key} is unknown")
        old = fitted.get(key, _default(model_class, key))
        if old is None:
            continue
        fitted[key] = new_heads * head_dim
        changes.append(f"{key} {old}->{fitted[key]}")


_INDEX = re.compile(r"^\d+$")


def plan_block_needs(plan: dict) -> dict[str, tuple[int, str]]:
    """The block lists a plan names by index: list path -> (length it needs, the plan key that needs most).

    Keys are dotted module paths (`blocks.39.attn1`, `transformer_blocks.0`, `blocks.*.ffn`); a numeric part
    names an index into the list the parts before it lead to. `*` needs nothing (it matches what exists),
    and a nested list's path writes the outer indices as `*`: `stages.1.blocks.3` needs `stages` >= 2 and
    `stages.*.blocks` >= 4. Non-string keys (the `rope` output indices inside an entry) are not paths.
    """
    needs: dict[str, tuple[int, str]] = {}
    for key in plan or {}:
        if not isinstance(key, str) or not key:
            continue
        parts = key.split(".")
        for i, part in enumerate(parts):
            if i == 0 or not _INDEX.match(part):
                continue
            path = ".".join("*" if _INDEX.match(p) else p for p in parts[:i])
            length = int(part) + 1
            if length > needs.get(path, (0, ""))[0]:
                needs[path] = (length, key)
    return needs


def block_count_key(model_class: type, path: str) -> str | None:
    """The init key that sets the length of the block list at `path`, or None when it is not known.

    Lists not in the tables are fitted only when they hang off the model itself (`layers.7`): those are
    stacks, and one without a known key is `Unfittable`. A list deeper in (`blocks.*.attn.to_out.0`) is
    taken to be a block's own structure and left alone: diffusers' plans name `to_out.0` and `ff.net.2`."""
    return BLOCK_COUNT_KEYS.get(model_class.__name__, {}).get(path, BLOCK_COUNT_KEYS_DEFAULT.get(path))


def fit_block_counts(model_class: type, init_dict: dict, plans) -> tuple[dict, list[str]]:
    """A copy of `init_dict` with every block list the plans name by index long enough, and the changes.

    `plans` is `[(plan name, plan), ...]`, e.g. `[("_cp_plan", cls._cp_plan)]`; the name goes into the
    reason when a list cannot be fitted (no known key, or a key that is not a plain integer).
    """
    name = model_class.__name__
    fitted = dict(init_dict)
    changes: list[str] = []
    for plan_name, plan in plans:
        for path, (length, plan_key) in sorted(plan_block_needs(plan).items()):
            key = block_count_key(model_class, path)
            if key is None and ("." in path or length == 1):
                # A list inside a block (`attn.to_out.0`, `ff.net.2`) is the block's fixed structure, not a
                # stack a config sizes; and index 0 of a stack exists in any model that has blocks.
                continue
            if key is None or key not in _init_keys(model_class):
                raise Unfittable(
                    f"{name}: {plan_name} names {plan_key!r}, so {path!r} needs {length} blocks, but which init "
                    f"key sets its length is not known (add it to paracheck.adapters.diffusers.fitting.BLOCK_COUNT_KEYS)"
                )
            count = fitted.get(key, _default(model_class, key))
            if not isinstance(count, int) or isinstance(count, bool):
                raise Unfittable(f"{name}: {plan_name} names {plan_key!r}, but {key} is {count!r}, not a block count")
            if count < length:
                fitted[key] = length
                changes.append(f"{key} {count}->{length} ({plan_name} names {plan_key})")
    return fitted, changes


def cp_split_problems(model_class: type, inputs: dict, layout: Layout) -> list[str]:
    """Top-level inputs the `_cp_plan` splits whose split dimension the CP degree does not divide (the entries
    inside the model need a trace: `splits.plan_splits`, judged by `split_problems`)."""
    return split_problems([(f"input {key!r}", dim, size)
                           for key, (dim, size) in cp_split_sizes(model_class, inputs).items()], layout)


def split_problems(splits, layout: Layout) -> list[str]:
    """The rule: the CP degree must divide every length a `_cp_plan` entry splits, top-level or inside the
    model (diffusers' `EquipartitionSharder` cuts it into equal shards, one per CP rank, and asserts that).
    `splits`: `(what, dim, size)` each (`splits.Split`); one sentence per size it refuses, naming every split
    of that size (MiniMax-H3's packed sequence is split at five places)."""
    if not layout.has_cp:
        return []
    refused: dict[int, list[str]] = {}
    for what, dim, size in splits:
        if size % layout.cp and f"{what} dim {dim}" not in refused.get(size, []):
            refused.setdefault(size, []).append(f"{what} dim {dim}")
    return [f"{', '.join(named)} {'has' if len(named) == 1 else 'have'} size {size}, which the CP degree "
            f"{layout.cp} (ring {layout.ring} x ulysses {layout.ulysses}) does not divide (the _cp_plan splits "
            f"{'it' if len(named) == 1 else 'each'} into {layout.cp} equal shards, one per CP rank)"
            for size, named in refused.items()]


def cp_split_sizes(model_class: type, inputs: dict) -> dict[str, tuple[int, int]]:
    """Top-level inputs the `_cp_plan` splits: name -> (split dimension, its size)."""
    plan = (getattr(model_class, "_cp_plan", None) or {}).get("", {})
    sizes = {}
    if not isinstance(plan, dict):
        return sizes
    for key, spec in plan.items():
        value = inputs.get(key) if isinstance(key, str) else None
        if value is None or not hasattr(value, "shape") or getattr(spec, "split_output", False):
            continue
        expected = getattr(spec, "expected_dims", None)
        if expected is not None and value.dim() != expected:
            continue  # diffusers leaves it unsplit; the worker reports that as a finding
        sizes[key] = (spec.split_dim, value.shape[spec.split_dim])
    return sizes


def _init_keys(model_class: type) -> set[str]:
    import inspect

    try:
        return set(inspect.signature(model_class.__init__).parameters)
    except (TypeError, ValueError):
        return set()


def init_value(model_class: type, init_dict: dict, key: str):
    """The value `key` takes when `model_class(**init_dict)` is built: given, or the class's default."""
    return init_dict[key] if key in init_dict else _default(model_class, key)


def _default(model_class: type, key: str):
    import inspect

    try:
        parameter = inspect.signature(model_class.__init__).parameters.get(key)
    except (TypeError, ValueError):
        return None
    return None if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default
