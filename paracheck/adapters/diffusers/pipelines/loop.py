"""One run of a pipeline, recorded step by step: the latents after every denoising step (through the pipeline's own
`callback_on_step_end`), the decoded output, and, where asked, every transformer call's inputs by step.

The inputs are taken by a forward pre-hook on the transformer, which runs before diffusers' own hooks (the
context-parallel split among them), so they are the whole tensors the pipeline passed: what a localization reruns,
inside the cache context the pipeline had entered for the call (`cache_context(name, ...)`, which cache hooks need).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: What every pipeline case's call is given by the kit: the decoded output as tensors, a tuple back.
CALL = dict(output_type="pt", return_dict=False)


@dataclass
class Recording:
    """A pipeline run: the latents after each step, the decoded output, each transformer call's inputs by step."""
    steps: list = field(default_factory=list)
    output: torch.Tensor | None = None
    #: (step, positional arguments, keyword arguments, cache context as (name, keyword arguments) or None) of every
    #: transformer call, when recorded.
    calls: list = field(default_factory=list)

    @property
    def final(self) -> torch.Tensor:
        return self.steps[-1]


def pipeline_of(source, components: dict):
    pipe = source.pipeline_class(**components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run(pipe, inputs: dict, record_calls: bool = False) -> Recording:
    """`pipe(**inputs)` under `torch.no_grad()` (the inputs say how many steps), recorded."""
    rec = Recording()

    def after_step(pipeline, index, timestep, tensors):
        rec.steps.append(tensors["latents"].detach().clone())
        return {}

    handle, transformer, entered, seen = None, pipe.transformer, [], {}
    if record_calls:
        def before_call(module, args, kwargs):
            rec.calls.append((len(rec.steps), args, _detached(kwargs, seen), entered[-1] if entered else None))
        handle = transformer.register_forward_pre_hook(before_call, with_kwargs=True)
        transformer.cache_context = _recording_context(transformer.cache_context, entered)
    try:
        with torch.no_grad():
            out = pipe(**dict(inputs, callback_on_step_end=after_step,
                              callback_on_step_end_tensor_inputs=["latents"], **CALL))
    finally:
        if handle is not None:
            handle.remove()
            del transformer.cache_context
    rec.output = _stacked(out[0] if isinstance(out, (tuple, list)) else out)
    return rec


def _stacked(output):
    """The decoded output as one tensor: a pipeline that returns a list of them, one per batch entry (Qwen-Image
    Layered's, each its layers' pictures), has them stacked."""
    if isinstance(output, (list, tuple)) and output and all(isinstance(t, torch.Tensor) for t in output):
        return torch.stack(list(output))
    return output


def _recording_context(cache_context, entered: list):
    """`cache_context` that keeps the context the pipeline entered last, (name, keyword arguments)."""
    import contextlib

    @contextlib.contextmanager
    def recording(name, **kwargs):
        entered.append((name, kwargs))
        with cache_context(name, **kwargs):
            yield
    return recording


class Held:
    """A state object transformer calls were given (a pipeline's own cache, which the calls fill: QwenImage 2.1's
    `kv_cache`, written on step 1 and read after): its contents when the loop first passed it. A replay gives each
    transformer its own copy of those, once, and the same copy at every later call (`owned`), so each model reads
    back what it wrote itself (the parallel one's holds its shards)."""

    def __init__(self, first):
        self.first = first


def _detached(value, seen: dict):
    """A transformer call's argument as it was at the call: tensors cloned, a state object held (`Held`)."""
    import copy

    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _detached(v, seen) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v, seen) for v in value)
    if hasattr(value, "__dict__") and not isinstance(value, (type, torch.nn.Module)):
        if id(value) not in seen:  # the pipeline holds it for the whole loop, so its id stays its own
            seen[id(value)] = Held(copy.deepcopy(value))
        return seen[id(value)]
    return value


def owned(value, copies: dict):
    """A recorded argument for one transformer's replay: each `Held` as that transformer's own copy (`copies`: the
    copies it holds, kept over its replayed steps)."""
    import copy

    if isinstance(value, Held):
        return copies.setdefault(id(value), copy.deepcopy(value.first))
    if isinstance(value, dict):
        return {k: owned(v, copies) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(owned(v, copies) for v in value)
    return value


def first_image(output: torch.Tensor) -> torch.Tensor:
    """The first sample's first picture as (channels, height, width): an image batch is (batch, channels, height,
    width), a video batch (batch, frames, channels, height, width)."""
    picture = output[0]
    while picture.dim() > 3:
        picture = picture[0]
    return picture
