"""A model case as files: the pytest process writes it, the ranks read it without importing the test module.

`case.json` holds the model class's import path, the init dict and the inputs' structure; tensors go to
`tensors.safetensors`. Tuples are tagged so that `img_shapes=[(1, 4, 4)]` comes back as a list of tuples.
"""

from __future__ import annotations

import importlib
import json
import os

_TUPLE, _TENSOR = "__tuple__", "__tensor__"


def dump(directory: str, model_class: type, init_dict: dict, inputs: dict) -> str:
    import torch
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}

    def encode(value):
        if isinstance(value, torch.Tensor):
            key = f"t{len(tensors)}"
            tensors[key] = value.detach().cpu().contiguous()
            return {_TENSOR: key}
        if isinstance(value, tuple):
            return {_TUPLE: [encode(v) for v in value]}
        if isinstance(value, list):
            return [encode(v) for v in value]
        if isinstance(value, dict):
            return {str(k): encode(v) for k, v in value.items()}
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise TypeError(f"cannot hand {type(value).__name__} to the ranks; use tensors, numbers, strings, "
                        "lists, tuples and dicts")

    os.makedirs(directory, exist_ok=True)
    data = {"model_class": f"{model_class.__module__}:{model_class.__qualname__}",
            "init_dict": encode(init_dict), "inputs": encode(inputs)}
    save_file(tensors, os.path.join(directory, "tensors.safetensors"))
    tmp = os.path.join(directory, "case.json.tmp")
    with open(tmp, "w") as handle:
        json.dump(data, handle)
    os.replace(tmp, os.path.join(directory, "case.json"))
    return directory


def load(directory: str):
    from safetensors.torch import load_file

    with open(os.path.join(directory, "case.json")) as handle:
        data = json.load(handle)
    tensors = load_file(os.path.join(directory, "tensors.safetensors"))

    def decode(value):
        if isinstance(value, dict):
            if _TENSOR in value:
                return tensors[value[_TENSOR]]
            if _TUPLE in value:
                return tuple(decode(v) for v in value[_TUPLE])
            return {k: decode(v) for k, v in value.items()}
        if isinstance(value, list):
            return [decode(v) for v in value]
        return value

    module, _, qualname = data["model_class"].partition(":")
    model_class = importlib.import_module(module)
    for part in qualname.split("."):
        model_class = getattr(model_class, part)
    return model_class, decode(data["init_dict"]), decode(data["inputs"])
