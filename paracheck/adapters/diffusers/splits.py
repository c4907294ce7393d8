"""What a model's `_cp_plan` splits in one call: each entry's tensor, the dim it splits and that dim's size,
entries inside the model (`rope`, `transformer_blocks.0`) as well as the top-level ones.

Read for the fitting rule (`fitting.split_problems`), before any parallel code: the top-level entries from the
call's own inputs; an entry inside the model from one forward of the model on meta (shapes, no values, no
weights), with a hook on each module the plan names. A plan with no inner split entry (Flux) costs nothing more;
one forward on meta of a bundled fixture costs 40-180 ms (measured at load 9), once per source and fit in a
process (`plan.Sources`). A forward meta cannot run (Helios: a kernel with no meta rule) yields the entries
reached before it raised; the run itself still catches the rest as an error, as it did before. `plan_modules`
resolves a plan key to its modules for every reader (the structure check, localization, this).
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch


class Split(NamedTuple):
    """One tensor a `_cp_plan` entry splits: what it is (for the reason), the dim it splits, that dim's size."""
    what: str
    dim: int
    size: int


def plan_splits(model_class: type, init_dict: dict, inputs: dict) -> list[Split]:
    """Every tensor the class's `_cp_plan` splits in the call `model_class(**init_dict)(**inputs)`."""
    from paracheck.adapters.diffusers.fitting import cp_split_sizes

    found = [Split(f"input {key!r}", dim, size) for key, (dim, size) in cp_split_sizes(model_class, inputs).items()]
    inner = inner_entries(getattr(model_class, "_cp_plan", None) or {})
    if inner:
        found += traced_splits(model_class, init_dict, inputs, inner)
    return list(dict.fromkeys(found))


def inner_entries(plan: dict) -> dict:
    """The plan's entries on modules inside the model that split something (gather points split nothing)."""
    return {module_id: entry for module_id, entry in plan.items()
            if module_id and isinstance(entry, dict) and entry}


def traced_splits(model_class: type, init_dict: dict, inputs: dict, entries: dict) -> list[Split]:
    """The inner entries' splits, read by hooks on one forward on meta; those reached before a raise."""
    from paracheck.adapters.diffusers.simulate.fakeworld import build_meta, meta_inputs, quiet

    found: list[Split] = []
    handles = []
    with quiet():
        try:
            model = build_meta(model_class, init_dict)
            for module_id, entry in entries.items():
                for module in plan_modules(model, module_id):
                    handles.append(module.register_forward_hook(_recorder(module_id, entry, module, found),
                                                                with_kwargs=True))
            with torch.no_grad():
                model(**meta_inputs(inputs))
        except Exception:  # noqa: BLE001 - what meta cannot run, the run itself reports
            pass
        finally:
            for handle in handles:
                handle.remove()
    return found


def _recorder(module_id: str, entry: dict, module, found: list[Split]):
    """A forward hook recording what `entry` splits on this call: named inputs (keyword or positional, as
    diffusers' split hook reads them) and, for `split_output` specs, the output's items by index."""
    try:
        names = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        names = []

    def hook(_module, args, kwargs, output):
        outputs = [output] if isinstance(output, torch.Tensor) else list(output) \
            if isinstance(output, (list, tuple)) else []
        for key, spec in entry.items():
            if getattr(spec, "split_output", False):
                value = outputs[key] if isinstance(key, int) and key < len(outputs) else None
                what = f"{module_id}'s output {key}"
            else:
                value = kwargs.get(key)
                if value is None and key in names and names.index(key) < len(args):
                    value = args[names.index(key)]
                what = f"{module_id}'s input {key!r}"
            split = _split(what, spec, value)
            if split is not None:
                found.append(split)

    return hook


def _split(what: str, spec, value) -> Split | None:
    """The split `spec` makes of `value`; None where diffusers splits nothing (not a tensor, or not the number
    of dims the spec expects: the library leaves it whole)."""
    if not isinstance(value, torch.Tensor) or not hasattr(spec, "split_dim"):
        return None
    expected = getattr(spec, "expected_dims", None)
    if expected is not None and value.dim() != expected:
        return None
    return Split(what, spec.split_dim, value.shape[spec.split_dim])


def plan_modules(model, module_id: str) -> list:
    """Modules a `_cp_plan` key names; `*` expands over a ModuleList (resolved here, not by diffusers)."""
    modules = [model]
    for atom in [a for a in module_id.split(".") if a] if module_id else []:
        nxt = []
        for module in modules:
            nxt.extend(list(module) if atom == "*" else [getattr(module, atom)])
        modules = nxt
    return modules
