"""Parameter and module names seen through the wrappers torch and its users put around a module.

Activation checkpointing (`checkpoint_wrapper`, `offload_wrapper`) keeps the wrapped block in
`_checkpoint_wrapped_module`, `torch.compile` in `_orig_mod`, FSDP1 in `_fsdp_wrapped_module`, DDP in `module`:
each adds a component to the name of everything inside (`h.0._checkpoint_wrapped_module.attn.c_q.weight`). The
kit compares a parallel model with its reference by name, and a user wraps one side only, so every check and
localization reads names with the wrapper's component dropped (`h.0.attn.c_q.weight`), as torch's own
`get_model_state_dict` does. A wrapper is recognised by its class (a user's module may well have a child named
`module`), and the component dropped only under it. FSDP2's `fully_shard`, TP's `parallelize_module` and
pipelining's stages wrap nothing, so they need no entry.
"""

from __future__ import annotations

import sys

import torch


#: (module, class, the attribute holding the wrapped module) of each wrapper the kit reads names through.
WRAPPERS = (
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "ActivationWrapper", "_checkpoint_wrapped_module"),
    ("torch._dynamo.eval_frame", "OptimizedModule", "_orig_mod"),
    ("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel", "_fsdp_wrapped_module"),
    ("torch.nn.parallel.distributed", "DistributedDataParallel", "module"),
)


def wrappers() -> list[tuple[type, str]]:
    """(wrapper class, its attribute) for each wrapper whose module is imported: a module never imported made no
    wrapper, so nothing is imported here (torch._dynamo alone takes a second)."""
    found = []
    for module, name, attribute in WRAPPERS:
        kind = getattr(sys.modules.get(module), name, None)
        if kind is not None:
            found.append((kind, attribute))
    return found


def inner_attribute(module: torch.nn.Module) -> str | None:
    """The attribute a wrapper keeps its wrapped module in; None for a module that wraps nothing."""
    return next((attribute for kind, attribute in wrappers() if isinstance(module, kind)), None)


def modules(model: torch.nn.Module) -> dict[str, str]:
    """Every module's name as `named_modules` gives it -> its name with the wrappers' components dropped (a
    wrapper and the module it wraps share one name)."""
    out = {"": ""}

    def walk(module, raw: str, clean: str) -> None:
        skip = inner_attribute(module)
        for child_name, child in module.named_children():
            child_raw = f"{raw}.{child_name}" if raw else child_name
            child_clean = clean if child_name == skip else (f"{clean}.{child_name}" if clean else child_name)
            if child_raw not in out:
                out[child_raw] = child_clean
                walk(child, child_raw, child_clean)

    walk(model, "", "")
    return out


def hooked(model: torch.nn.Module) -> dict[str, str]:
    """The modules localization records, by raw name -> clean name: every module but the wrappers themselves
    (a wrapper's call and its wrapped module's are one call under one name; the wrapped one is kept)."""
    clean = modules(model)
    return {raw: clean[raw] for raw, module in model.named_modules() if inner_attribute(module) is None}


def clean(name: str, table: dict[str, str]) -> str:
    """A parameter's (or a module's) raw name, through `table` (`modules(model)`)."""
    owner, _, leaf = name.rpartition(".")
    if name in table:
        return table[name]
    base = table.get(owner, owner)
    return f"{base}.{leaf}" if base else leaf


def parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """`named_parameters()` by clean name, in its order (a parameter shared by two modules, a tied head, once)."""
    table = modules(model)
    out: dict = {}
    for name, param in model.named_parameters():
        out.setdefault(clean(name, table), param)
    return out
