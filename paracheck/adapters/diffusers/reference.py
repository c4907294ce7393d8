"""Single-device references: computed once per run per plan key, shared through the run directory.

A case's plan (`plan.Plan`) names its reference by key. The reference itself (weights, output, loss
weights, gradients) is computed by one rank, when the first case that needs it comes up, and written to the
run directory as safetensors; every rank that needs it reads it. Owners are dealt out round-robin over the keys, so the work spreads over the ranks (the
others wait for the file meanwhile). Each rank keeps the one reference it read last, for the next case
(often its control) to share; memory stays flat in the number of cases.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from paracheck.world.recent import Recent

from paracheck.adapters.diffusers import attention
from paracheck.adapters.diffusers.fitting import Unfittable
from paracheck.launch.protocol import read_json, reference_error_file, reference_file, write_json
from paracheck.adapters.diffusers.plan import Plan
from paracheck.adapters.diffusers.weights import copy_of

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def forward(model, inputs: dict):
    return model(**dict(inputs), return_dict=False)[0]


def place(value, device: torch.device, dtype: torch.dtype | None = None):
    """Inputs on the rank's device: every tensor moved, floating ones also cast to the run's dtype."""
    if isinstance(value, torch.Tensor):
        return value.to(device, dtype) if dtype is not None and value.is_floating_point() else value.to(device)
    if isinstance(value, dict):
        return {k: place(v, device, dtype) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(place(v, device, dtype) for v in value)
    return value


def _run(model, inputs: dict, weights: torch.Tensor | None, grads: bool):
    out = forward(model, inputs)
    if weights is None:
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1234)).to(out.device, out.dtype)
    if grads:
        (out * weights.to(out.dtype)).sum().backward()
    return out, weights


def compute(p: Plan, refs_dir: str, device: torch.device) -> None:
    """Run the fitted model on this rank's device alone, in fp32 and (if different) in the run's dtype,
    forward and backward, and write the result for every rank to read."""

    dtype = torch_dtype(p.case.dtype)
    torch.manual_seed(0)
    model32 = p.model_class(**p.init_dict).eval().to(device)
    try:
        with attention.scope(p.attention):
            out32, weights = _run(model32, place(p.inputs, device, torch.float32), None, p.case.grads)
            model, out = model32, out32
            if dtype != torch.float32:
                model = p.model_class(**p.init_dict).eval()
                model.load_state_dict(model32.state_dict())
                model = model.to(device, dtype)
                out, _ = _run(model, place(p.inputs, device, dtype), weights, p.case.grads)
    except Exception as exc:
        what = f"the fitted config ({', '.join(p.fit)})" if p.fit else "the model, unchanged,"
        write_json(reference_error_file(refs_dir, p.key),
                   {"error": f"{what} failed on one device: {type(exc).__name__}: {exc}", "fitted": bool(p.fit)})
        return
    tensors = {f"state.{k}": v for k, v in model.state_dict().items()}
    tensors.update({f"grad.{n}": q.grad for n, q in model.named_parameters() if q.grad is not None})
    if dtype != torch.float32:
        tensors.update({f"grad32.{n}": q.grad for n, q in model32.named_parameters() if q.grad is not None})
        tensors["out32"] = out32
    tensors.update(out=out, weights=weights)
    _save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, reference_file(refs_dir, p.key))


def _save(tensors: dict, path: str) -> None:
    from safetensors.torch import save_file

    tmp = f"{path}.tmp.{os.getpid()}"
    save_file(tensors, tmp)
    os.replace(tmp, path)


def exists(p: Plan, refs_dir: str) -> bool:
    return os.path.exists(reference_file(refs_dir, p.key)) or os.path.exists(reference_error_file(refs_dir, p.key))


@dataclass
class Reference:
    """One device's answer, on this rank's device: the model (weights and gradients) in the run's dtype,
    its output, the loss weights, and, for a reduced-precision run, the fp32 output and gradients."""
    model: torch.nn.Module
    out: torch.Tensor
    weights: torch.Tensor
    out32: torch.Tensor | None = None
    grads32: dict = field(default_factory=dict)
    inputs: dict = field(default_factory=dict)


def load(p: Plan, refs_dir: str, device: torch.device, wait: float = 3600.0) -> Reference:
    """The reference for `p`, waiting for the rank that computes it; raises Unfittable if fitting failed."""
    from safetensors.torch import load_file


    deadline = time.time() + wait
    while not os.path.exists(reference_file(refs_dir, p.key)):
        failed = read_json(reference_error_file(refs_dir, p.key))
        if failed and failed["fitted"]:
            raise Unfittable(failed["error"])  # fitting could not make the model take the layout
        if failed:
            raise RuntimeError(failed["error"])  # the user's model is broken on one device
        if time.time() > deadline:
            raise TimeoutError(f"reference {p.key} never appeared")
        time.sleep(0.02)
    tensors = {k: v.to(device) for k, v in load_file(reference_file(refs_dir, p.key)).items()}
    dtype = torch_dtype(p.case.dtype)
    torch.manual_seed(0)
    model = copy_of(p.model_class, p.init_dict, {k[6:]: v for k, v in tensors.items() if k.startswith("state.")},
                    device, dtype)
    for name, param in model.named_parameters():
        param.grad = tensors.get(f"grad.{name}")
    grads32 = {k[7:]: v for k, v in tensors.items() if k.startswith("grad32.")}
    return Reference(model, tensors["out"], tensors["weights"], tensors.get("out32"), grads32,
                     place(p.inputs, device, dtype))


class LastReference:
    """The reference this rank read last, kept for the next case: consecutive cases often share one (a
    plain case and its controls), and reading it again costs a model construction. One at most, dropped
    before another is read, so memory stays flat in the number of cases (a cache of several, measured,
    held tens of MiB more per rank for a few percent of CPU). Nothing in a case writes to its reference."""

    def __init__(self):
        self._kept = Recent(1, "diffusers reference")

    def get(self, p: Plan, refs_dir: str, device: torch.device) -> Reference:
        return self._kept.get(p.key, lambda: load(p, refs_dir, device))
