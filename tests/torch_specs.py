"""Specs for the torch adapter's tests: broken ones (each breaks one rule) and one whose parallelize raises."""

import functools
import sys

import torch
from torch import nn

from paracheck.adapters.torch.spec import Spec


def _build():
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _parallelize(model, mesh, layout):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if layout.tp > 1:
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model


def _inputs(layout, variant):
    return {"input": torch.randn(4, 8)}


class no_parallelize:
    library = "torch"
    build = staticmethod(_build)
    inputs = staticmethod(_inputs)


class no_build:
    parallelize = staticmethod(_parallelize)
    inputs = staticmethod(_inputs)


def _raises(layout, variant):
    raise KeyError("vocab")


inputs_raise = Spec(_build, _parallelize, _raises)
inputs_list = Spec(_build, _parallelize, lambda layout, variant: [torch.randn(4, 8)])
only_tp4 = Spec(_build, _parallelize, _inputs, layouts=("tp4",))
refuses_tp = Spec(_build, _parallelize, _inputs, supports=lambda layout: "no TP here" if layout.tp > 1 else None)
bad_reduction = Spec(_build, _parallelize, _inputs, grad_reduction="avg")
bad_layouts = Spec(_build, _parallelize, _inputs, layouts=("tp2xring2",))
batch_odd = Spec(_build, _parallelize, lambda layout, variant: torch.randn(3, 8))
mlp = Spec(_build, _parallelize, _inputs, layouts=("tp2",))


def _parallelize_raises(model, mesh, layout):
    raise RuntimeError("plan names a module 'mlp.fc9' the model lacks")


parallelize_raises = Spec(_build, _parallelize_raises, _inputs)
#: TP only: on an fsdp layout it shards nothing (right numbers, computed redundantly), which structure.mesh names.
tp_only = Spec(_build, _parallelize, _inputs)


def _llama():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "llama_tp_fsdp.py")
    loader = importlib.util.spec_from_file_location("paracheck_test_specs_llama", path)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    return module


_LLAMA = _llama()


def _parallelize_late_bug(model, mesh, layout):
    """The example's own plan (sequence parallel, then FSDP), then the last block's w2 weight 1 % off on every rank:
    a difference that arises in one module, after every other kind of split the plan makes."""
    _LLAMA.parallelize(model, mesh, layout)
    weight = model.layers["1"].feed_forward.w2.weight
    with torch.no_grad():
        (weight.to_local() if hasattr(weight, "to_local") else weight).mul_(1.01)
    return model


#: Localization's test: every module before layers.1.feed_forward.w2 agrees once read back, and that one is the origin.
llama_late_bug = Spec(_LLAMA.build, _parallelize_late_bug, _LLAMA.inputs, supports=_LLAMA.supports)


def _example(name: str):
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", name)
    loader = importlib.util.spec_from_file_location(f"paracheck_test_specs_{name[:-3]}", path)
    if loader.name not in sys.modules:  # registered: compile imports a checkpointed function's module by name
        sys.modules[loader.name] = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(sys.modules[loader.name])
    return sys.modules[loader.name]


_GPT2 = _example("gpt2_tp_fsdp.py")
#: The example's per-block compile on aot_eager (dynamo and AOTAutograd, as inductor's front; no C++ to build), and
#: with activation checkpointing before it (a declared torch failure on TP layouts).
#: (tp2 only in the suite: each compiled layout costs seconds; gpt2_ac_compile's fsdp2 holds compile under FSDP.)
gpt2_compile = Spec(_GPT2.build, functools.partial(_GPT2.parallelize, compile="aot_eager"), _GPT2.inputs,
                    supports=_GPT2.supports, layouts=("tp2",))
gpt2_ac_compile = Spec(_GPT2.build, functools.partial(_GPT2.parallelize, ac=True, compile="aot_eager"), _GPT2.inputs,
                       supports=_GPT2.supports)


def _late_bug(parallelize):
    """`parallelize`, then h.1's MLP down projection 1 % off on every rank, found by its name through the wrappers."""
    def planted(model, mesh, layout):
        from paracheck.adapters.torch import names

        parallelize(model, mesh, layout)
        weight = names.parameters(model)["h.1.mlp.c_proj.weight"]
        with torch.no_grad():
            (weight.to_local() if hasattr(weight, "to_local") else weight).mul_(1.01)
        return model
    return planted


#: Localization through checkpoint_wrapper and through per-block compile: the origin is the module's own name.
gpt2_ac_late_bug = Spec(_GPT2.build, _late_bug(functools.partial(_GPT2.parallelize, ac=True)), _GPT2.inputs,
                        layouts=("tp2",))
gpt2_compile_late_bug = Spec(_GPT2.build, _late_bug(functools.partial(_GPT2.parallelize, compile="aot_eager")),
                             _GPT2.inputs, layouts=("tp2",))
