"""What a pipeline case is built from (`Source`): a class in diffusers' pipeline-tester convention, or the file a
pipeline mixin wrote for the ranks.

The convention: `pipeline_class` (an attribute or a property), `get_dummy_components()` (every component, models
built from configs) and `get_dummy_inputs(device, seed)` (the call's keyword arguments; diffusers' newer testers
take neither and draw their generator from `get_generator(seed)`, which is honoured too). Optional `paracheck_*`
attributes are read as `fixtures/pipelines.py` describes them.
"""

from __future__ import annotations

import inspect
import os

from paracheck.domain.case import SpecError, load_object

#: How a pipeline runs classifier-free guidance (`paracheck_guidance`): one call on the doubled batch, one call per
#: branch, or none (a distilled model takes the scale as an input).
GUIDANCE = ("batched", "calls", "none")
#: The call's argument that says how many steps the pipeline denoises, unless `paracheck_steps_input` names another.
STEPS_INPUT = "num_inference_steps"
#: The payload file of a pipeline mixin's case (`dump`).
PAYLOAD_FILE = "pipeline.pt"


class Source:
    """One pipeline case's makings on a rank: its class, fresh components, the call's inputs, and the kit's options."""

    def __init__(self, pipeline_class, components, inputs, guidance: str = "calls", steps: int | None = None,
                 caches: dict | None = None, name: str = "", steps_input: str | None = None):
        self.pipeline_class, self._components, self._inputs = pipeline_class, components, inputs
        self.guidance, self.caches, self.name = guidance, dict(caches or {}), name
        self.steps, self.steps_input = steps, steps_input or STEPS_INPUT
        if guidance not in GUIDANCE:
            raise SpecError(f"{name}: paracheck_guidance {guidance!r} must be one of {', '.join(GUIDANCE)}")

    def components(self) -> dict:
        """Every component, built afresh (the callers own and change them)."""
        return self._components()

    def inputs(self, seed: int = 0) -> dict:
        """The pipeline call's keyword arguments, its generator seeded afresh."""
        return self._inputs(seed)

    def default_steps(self) -> int:
        given = self.inputs().get(self.steps_input)
        if isinstance(given, (list, tuple)):
            given = len(given) if any(isinstance(x, float) for x in given) else sum(given)
        return int(self.steps or given or 2)

    def step_inputs(self, steps: int) -> dict:
        """The call's argument that makes the pipeline denoise `steps` times: `num_inference_steps`, or the one
        `paracheck_steps_input` names. Where the inputs give that one a list, it is a count per stage (ints: Helios
        Pyramid's), over which the steps are spread, the earlier stages taking the remainder; or a schedule (floats:
        a distilled pipeline's sigmas), respaced evenly over its span at `steps` points."""
        given = self.inputs().get(self.steps_input)
        if not isinstance(given, (list, tuple)):
            return {self.steps_input: steps}
        if any(isinstance(x, float) for x in given):
            first, last = float(given[0]), float(given[-1])
            return {self.steps_input: [first + (last - first) * i / max(steps - 1, 1) for i in range(steps)]}
        stages = len(given)
        if steps < stages:
            raise SpecError(f"{self.name}: {steps} steps cannot be spread over {stages} stages")
        return {self.steps_input: [steps // stages + (i < steps % stages) for i in range(stages)]}


def is_tester(obj) -> bool:
    """Whether `obj` (a class or an instance) follows diffusers' pipeline-tester convention."""
    return all(hasattr(obj, name) for name in ("pipeline_class", "get_dummy_components", "get_dummy_inputs"))


def from_tester(obj, name: str = "") -> Source:
    """The source a tester class (or instance) gives."""
    tester = obj() if isinstance(obj, type) else obj
    return Source(tester.pipeline_class, tester.get_dummy_components, lambda seed: tester_inputs(tester, seed),
                  getattr(tester, "paracheck_guidance", "calls"), getattr(tester, "paracheck_steps", None),
                  getattr(tester, "paracheck_caches", None), name or type(tester).__name__,
                  getattr(tester, "paracheck_steps_input", None))


def tester_inputs(tester, seed: int) -> dict:
    """`get_dummy_inputs` called as the tester takes it: (device, seed), (device) or () with `get_generator`."""
    method = tester.get_dummy_inputs
    parameters = inspect.signature(method).parameters
    kwargs = {}
    if "device" in parameters:
        kwargs["device"] = "cpu"
    if "seed" in parameters:
        kwargs["seed"] = seed
    inputs = dict(method(**kwargs))
    if "seed" not in parameters and hasattr(tester, "get_generator") and "generator" in inputs:
        inputs["generator"] = tester.get_generator(seed)
    return inputs


def load(factory: str | None, payload: str | None = None) -> Source:
    """The source of a case: its payload file when a mixin wrote one, else the tester class its factory names."""
    if payload:
        return from_payload(payload)
    obj = load_object(factory)
    if not is_tester(obj):
        raise SpecError(f"--spec {factory!r}: a pipeline case needs pipeline_class, get_dummy_components() and "
                        "get_dummy_inputs(device, seed)")
    return from_tester(obj, factory.rpartition(":")[2])


# -- a mixin's case as one file for the ranks --------------------------------------------------------------------


def dump(directory: str, tester) -> str:
    """The tester's pipeline class, components and inputs (seed 0) as one file the ranks read without importing the
    test module: components are pickled (their classes are the libraries'), a generator kept as its state."""
    import torch

    os.makedirs(directory, exist_ok=True)
    inputs = {k: ("generator", v.get_state()) if isinstance(v, torch.Generator) else v
              for k, v in tester_inputs(tester, 0).items()}
    pipeline_class = tester.pipeline_class
    data = dict(pipeline_class=f"{pipeline_class.__module__}:{pipeline_class.__qualname__}",
                components=tester.get_dummy_components(), inputs=inputs,
                guidance=getattr(tester, "paracheck_guidance", "calls"), steps=getattr(tester, "paracheck_steps", None),
                caches=getattr(tester, "paracheck_caches", None), name=type(tester).__name__,
                steps_input=getattr(tester, "paracheck_steps_input", None))
    path = os.path.join(directory, PAYLOAD_FILE)
    torch.save(data, path + ".tmp")
    os.replace(path + ".tmp", path)
    return directory


def from_payload(directory: str) -> Source:
    import copy

    import torch

    data = torch.load(os.path.join(directory, PAYLOAD_FILE), weights_only=False)
    pipeline_class = load_object(data["pipeline_class"])

    def inputs(seed: int) -> dict:
        out = {}
        for key, value in data["inputs"].items():
            if isinstance(value, tuple) and len(value) == 2 and value[0] == "generator":
                value = torch.Generator().set_state(value[1])
            out[key] = copy.deepcopy(value)
        return out

    return Source(pipeline_class, lambda: copy.deepcopy(data["components"]), inputs, data["guidance"],
                  data["steps"], data["caches"], data["name"], data.get("steps_input"))
