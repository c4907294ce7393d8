"""The transformers side of the pytest mixins: the layouts a causal LM's plans allow, its checkpoint, its cases.

A tester config gives a tiny `PretrainedConfig` (`get_config()`) and optionally the model class. The pytest
process builds the model from it with a fixed seed and writes it with `save_pretrained` into a folder the
case names (`Case.payload`); every rank loads that folder with and without `distributed_config`, as it
loads the bundled fixtures. Nothing here imports torch or transformers at import time.
"""

from __future__ import annotations

import os

from paracheck.adapters.transformers.controls import applicable
from paracheck.adapters.transformers.fixtures import SEED, VARIANTS, write
from paracheck.adapters.transformers.layout import TfLayout, cp_supported, layouts_for
from paracheck.adapters.transformers.cases import cases_on

FACTORY = "payload"


def plan_layouts(config, world: int) -> list[TfLayout]:
    """Every layout of `world` ranks the config's plans allow: TP only with a `base_model_tp_plan`, EP only
    with a `base_model_ep_plan`, pipeline only with a `base_model_pp_plan` (each on the config or on its text
    config); FSDP and HSDP always."""
    from paracheck.adapters.transformers.fitting import has_plan

    has = {name: has_plan(config, name) for name in ("tp", "ep", "pp")}
    found = layouts_for(world, moe=has["ep"], cp_field=cp_supported(), pp=has["pp"])
    return [layout for layout in found if layout.tp == 1 or has["tp"]]


def refusal(config, layout, dtype: str = "fp32") -> str | None:
    """The fitting rule's sentence for a layout the user's config does not fit as it is (heads, widths, vocab by
    tp; layers by pp; experts by ep), so the mixin skips it before any rank starts; None when it fits."""
    from paracheck.adapters.transformers.fitting import Need, refusal as rule

    return rule(config, Need.of(layout, dtype))


def check_variants(variants) -> list[str]:
    """The mixin's `paracheck_variants`, each one the adapter makes inputs for; ValueError names the bad one."""
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"paracheck_variants {unknown}: a causal LM's variants are {', '.join(VARIANTS)}")
    return list(variants)


def write_checkpoint(config, model_class, folder: str) -> str:
    """The model of `config` (as `model_class`, else the causal LM class transformers maps it to), seeded,
    written with `save_pretrained` into `folder/checkpoint`; returns that path."""
    import torch
    from transformers import AutoModelForCausalLM

    path = os.path.join(folder, "checkpoint")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = model_class(config) if model_class else AutoModelForCausalLM.from_config(config)
    write(model.to(torch.float32), path)
    return path


def cases(name: str, checkpoint: str, layouts, variants, controls: bool, atol=None, rtol=None) -> list:
    """Per layout and variant: the plain case, then each control that applies to the layout."""
    return cases_on(name, FACTORY, layouts, variants, applicable if controls else (lambda layout: []),
                    payload=checkpoint, atol=atol, rtol=rtol)
