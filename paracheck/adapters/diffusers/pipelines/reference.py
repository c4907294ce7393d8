"""A pipeline case's single-device reference: the same pipeline, its components' weights, on this rank's device alone,
computed once per key by the rank that owns it and read from the run directory by the others.

The file holds every component's weights (`state.<component>.<name>`), the latents after each step (`step.<i>`),
the decoded output (`out`) and, for a reduced-precision run, the fp32 run's (`step32.<i>`, `out32`). Every rank
builds the pipeline's components itself and loads these weights over them, so the parallel pipeline starts from the
reference's exact weights whatever its components' constructors draw.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from paracheck.world.recent import Recent

from paracheck.adapters.diffusers import attention
from paracheck.adapters.diffusers.fitting import Unfittable
from paracheck.adapters.diffusers.pipelines import caches, loop
from paracheck.adapters.diffusers.reference import place, torch_dtype
from paracheck.launch.protocol import read_json, reference_error_file, reference_file, write_json


def modules(components: dict) -> dict:
    return {name: c for name, c in components.items() if isinstance(c, torch.nn.Module)}


def pipeline_on(p, components: dict, device: torch.device, dtype: torch.dtype):
    """The plan's pipeline of `components` on `device` in `dtype`, its cache (if the case runs one) enabled."""
    for module in modules(components).values():
        module.to(device, dtype).eval()
    pipe = p.pipeline(components)
    if p.cache:
        caches.enable(pipe, p.cache, p.steps, p.source.guidance, p.source.caches.get(p.cache, {}))
    return pipe


def run(p, pipe, device: torch.device, dtype: torch.dtype, record_calls: bool = False) -> loop.Recording:
    return loop.run(pipe, place(p.inputs(), device, dtype), record_calls)


def compute(p, refs_dir: str, device: torch.device) -> None:
    """Run the plan's pipeline on this rank's device alone (fp32, then the run's dtype from the same weights) and
    write what every rank compares against."""
    dtype = torch_dtype(p.case.dtype)
    try:
        with attention.scope(p.attention):
            components = p.components()
            tensors = {f"state.{c}.{k}": v for c, m in modules(components).items() for k, v in m.state_dict().items()}
            pipe32 = pipeline_on(p, components, device, torch.float32)
            rec32 = run(p, pipe32, device, torch.float32)
            if p.cache:
                caches.inert(pipe32, p.cache)
            rec = rec32
            if dtype != torch.float32:
                rec = run(p, pipeline_on(p, components, device, dtype), device, dtype)
                tensors.update({f"step32.{i}": s for i, s in enumerate(rec32.steps)}, out32=rec32.output)
    except (caches.Refused, caches.Inert) as exc:
        write_json(reference_error_file(refs_dir, p.key), {"error": str(exc), "fitted": True})
        return
    except Exception as exc:
        if p.cache:  # the pipeline runs without the cache (its plain case says): it cannot run this one
            why = (f"diffusers' {p.source.pipeline_class.__name__} cannot run {p.cache} on one device: "
                   f"{type(exc).__name__}: {exc}")
            write_json(reference_error_file(refs_dir, p.key), {"error": why, "fitted": True})
            return
        write_json(reference_error_file(refs_dir, p.key),
                   {"error": f"the pipeline failed on one device: {type(exc).__name__}: {exc}", "fitted": False})
        return
    tensors.update({f"step.{i}": s for i, s in enumerate(rec.steps)}, out=rec.output)
    _save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, reference_file(refs_dir, p.key))


def _save(tensors: dict, path: str) -> None:
    from safetensors.torch import save_file

    tmp = f"{path}.tmp.{os.getpid()}"
    save_file(tensors, tmp)
    os.replace(tmp, path)


def exists(p, refs_dir: str) -> bool:
    return os.path.exists(reference_file(refs_dir, p.key)) or os.path.exists(reference_error_file(refs_dir, p.key))


@dataclass
class PipelineReference:
    """One device's run: every component's weights, the latents after each step, the decoded output; the fp32
    run's too for reduced precision; the transformer, built and holding its weights, in the run's dtype."""
    states: dict
    steps: list
    output: torch.Tensor
    transformer: torch.nn.Module
    steps32: list = field(default_factory=list)
    output32: torch.Tensor | None = None

    def components(self, p, device: torch.device, dtype: torch.dtype) -> dict:
        """Fresh components holding the reference's weights, on `device` in `dtype`."""
        components = p.components()
        for name, module in modules(components).items():
            module.load_state_dict(self.states[name])
            module.to(device, dtype).eval()
        return components


def load(p, refs_dir: str, device: torch.device, wait: float = 3600.0) -> PipelineReference:
    """The reference of plan `p`, waiting for the rank that computes it; Unfittable where diffusers refused."""
    from safetensors.torch import load_file

    deadline = time.time() + wait
    while not os.path.exists(reference_file(refs_dir, p.key)):
        failed = read_json(reference_error_file(refs_dir, p.key))
        if failed and failed["fitted"]:
            raise Unfittable(failed["error"])
        if failed:
            raise RuntimeError(failed["error"])
        if time.time() > deadline:
            raise TimeoutError(f"reference {p.key} never appeared")
        time.sleep(0.02)
    tensors = {k: v.to(device) for k, v in load_file(reference_file(refs_dir, p.key)).items()}
    states: dict = {}
    for key, value in tensors.items():
        if key.startswith("state."):
            component, _, name = key[6:].partition(".")
            states.setdefault(component, {})[name] = value
    count = sum(k.startswith("step.") for k in tensors)
    dtype = torch_dtype(p.case.dtype)
    ref = PipelineReference(states, [tensors[f"step.{i}"] for i in range(count)], tensors["out"], None,
                            [tensors[f"step32.{i}"] for i in range(count) if f"step32.{i}" in tensors],
                            tensors.get("out32"))
    ref.transformer = ref.components(p, device, dtype)["transformer"]
    return ref


class LastPipelineReference:
    """The pipeline reference this rank read last (a plain case and its controls share it); one at most."""

    def __init__(self):
        self._kept = Recent(1, "diffusers pipeline reference")

    def get(self, p, refs_dir: str, device: torch.device) -> PipelineReference:
        return self._kept.get(p.key, lambda: load(p, refs_dir, device))
