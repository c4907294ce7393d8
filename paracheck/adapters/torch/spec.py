"""A torch spec: what a user writes (build, parallelize, inputs, optionally loss), loaded and held to its shape.

A spec is any object with the functions as attributes: a `Spec(...)` (callable, so `--spec` loads it as it
loads a factory, and marked `library = "torch"`), a class, a module or a namespace. Validation runs before any
rank starts, and every error is one line naming the spec, what is wrong and the rule:

    build()                        -> the single-device nn.Module (the kit seeds torch first)
    parallelize(model, mesh, layout) -> None or the parallel module (torch's public parallel APIs; `mesh` is a
                                      DeviceMesh named by the layout's tokens, `layout` a `TorchLayout`)
    inputs(layout, variant)        -> the GLOBAL batch: a tensor or a dict of forward kwargs (batch on dim 0)
    loss(output, inputs)           -> optional; a scalar that is a MEAN over the batch (see docs/torch.md)
    layouts = ("tp2", ...)         -> optional: the layouts it runs (others are skips naming them)
    supports(layout) -> str | None -> optional: why it refuses `layout` (a skip in those words)
    variants = ("base", ...)       -> optional: the variants `inputs` takes
    grad_reduction = "mean"        -> optional: "sum" where the plan sums gradients over the data-parallel
                                      ranks (torchtitan's FSDP); the kit then divides each rank's loss by
                                      dp x fsdp before its backward, as torchtitan's global token count does
    pipeline(model, mesh, layout, loss_fn) -> optional: (stages, schedule) on a layout with pp: this rank's
                                      `PipelineStage`s and a `torch.distributed.pipelining` schedule built on
                                      them with `loss_fn` (the kit's loss of an output and a target); the kit
                                      drives the schedule (see `pipeline`)
    context_parallel = False       -> optional: True where the model enters torch's `context_parallel` itself;
                                      cp layouts are then skipped, naming why, on a device where it cannot run
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from paracheck.adapters.torch.layout import TorchLayout, TorchLayoutError
from paracheck.domain.case import SpecError, load_object

#: The functions a spec must have, with the signature each error names.
REQUIRED = {"build": "build()", "parallelize": "parallelize(model, mesh, layout)", "inputs": "inputs(layout, variant)"}
REDUCTIONS = ("mean", "sum")
SHAPE = "a torch spec names build(), parallelize(model, mesh, layout), inputs(layout, variant) and optionally " \
        "loss(output, inputs)"


@dataclass(frozen=True)
class Spec:
    build: Callable
    parallelize: Callable
    inputs: Callable
    loss: Callable | None = None
    layouts: tuple[str, ...] | None = None
    supports: Callable | None = None
    variants: tuple[str, ...] = ("base",)
    #: How the spec's data-parallel gradient reduction combines the ranks: "mean" (fully_shard's default) or
    #: "sum" (torchtitan's: a divide factor of 1, the loss scaled by the global token count instead).
    grad_reduction: str = "mean"
    #: pipeline(model, mesh, layout, loss_fn) -> (stages, schedule), on layouts with pp.
    pipeline: Callable | None = None
    #: The model's forward enters torch's context_parallel (a cp layout is skipped where it cannot run).
    context_parallel: bool = False

    #: Which adapter runs it (`domain.registry.library_of` reads this).
    library = "torch"

    def __call__(self) -> "Spec":
        return self


def load(path: str):
    """The object `path` (`module:attribute`, the module possibly a file path) names; SpecError names what failed."""
    return load_object(path, "examples/llama_tp_fsdp.py:spec")


def claims(obj) -> bool:
    """Whether a loaded object is a torch spec: it says so (`library = "torch"`), or it has a `parallelize`
    (no diffusers factory or transformers spec has one)."""
    return getattr(obj, "library", None) == "torch" or callable(getattr(obj, "parallelize", None))


def validate(path: str, obj) -> Spec:
    """`obj` as a `Spec`; SpecError names the first missing or malformed part."""
    if isinstance(obj, type) and not callable(getattr(obj, "build", None)):
        raise SpecError(f"--spec {path!r}: missing build() ({SHAPE})")
    if isinstance(obj, type):
        obj = obj()  # a class whose methods are the spec's functions (the pytest mixin's test classes)
    if isinstance(obj, Spec):
        spec = obj
    else:
        missing = [sig for name, sig in REQUIRED.items() if not callable(getattr(obj, name, None))]
        if missing:
            raise SpecError(f"--spec {path!r}: missing {', '.join(missing)} ({SHAPE})")
        spec = Spec(**{name: getattr(obj, name) for name in REQUIRED},
                    loss=getattr(obj, "loss", None), layouts=getattr(obj, "layouts", None),
                    supports=getattr(obj, "supports", None), variants=tuple(getattr(obj, "variants", ("base",))),
                    grad_reduction=getattr(obj, "grad_reduction", "mean"), pipeline=getattr(obj, "pipeline", None),
                    context_parallel=bool(getattr(obj, "context_parallel", False)))
    for name in REQUIRED:
        if not callable(getattr(spec, name)):
            raise SpecError(f"--spec {path!r}: {REQUIRED[name]} is not callable ({SHAPE})")
    if spec.pipeline is not None and not callable(spec.pipeline):
        raise SpecError(f"--spec {path!r}: pipeline must be a function pipeline(model, mesh, layout, loss_fn), got "
                        f"{type(spec.pipeline).__name__}")
    if spec.loss is not None and not callable(spec.loss):
        raise SpecError(f"--spec {path!r}: loss must be a function loss(output, inputs), got {type(spec.loss).__name__}")
    if spec.layouts is not None:
        if isinstance(spec.layouts, str) or not all(isinstance(n, str) for n in spec.layouts):
            raise SpecError(f"--spec {path!r}: layouts must be a tuple of names like ('tp2', 'tp2xfsdp2')")
        for name in spec.layouts:
            try:
                TorchLayout.parse(name)
            except TorchLayoutError as exc:
                raise SpecError(f"--spec {path!r}: its layouts: {exc}") from None
    if spec.grad_reduction not in REDUCTIONS:
        raise SpecError(f"--spec {path!r}: grad_reduction {spec.grad_reduction!r} must be one of "
                        f"{', '.join(REDUCTIONS)}")
    if not spec.variants or not all(isinstance(v, str) for v in spec.variants):
        raise SpecError(f"--spec {path!r}: variants must be a non-empty tuple of names")
    return spec


def loaded(path: str) -> Spec:
    """Load and validate in one step (the ranks call this too: the module is imported once per process)."""
    return validate(path, load(path))


def declared(spec: Spec, world: int) -> list[TorchLayout] | None:
    """The spec's own layouts of `world` ranks (canonical), or None where it declares none."""
    if spec.layouts is None:
        return None
    found = [TorchLayout.parse(n) for n in spec.layouts]
    return [l for i, l in enumerate(found) if l.world == world and l not in found[:i]]


def refusal(spec: Spec, layout: TorchLayout) -> str | None:
    """Why the spec (or the adapter, for cp it did not ask for) does not run `layout`; None when it does."""
    names = None if spec.layouts is None else [TorchLayout.parse(n).name for n in spec.layouts]
    if names is not None and layout.name not in names:
        return f"the spec runs only layouts {', '.join(names)}"
    if layout.cp > 1 and names is None:
        return ("cp: context parallelism runs inside the model's forward (torch's context_parallel); a spec that "
                "does it lists its cp layouts in `layouts`")
    if layout.pp > 1 and spec.pipeline is None:
        return ("pp: pipeline stages are the spec's to cut; a spec that pipelines names pipeline(model, mesh, layout, "
                "loss_fn) returning its stages and schedule")
    if spec.supports is not None:
        reason = spec.supports(layout)
        if reason is not None:
            return f"the spec refuses {layout.name}: {reason}"
    return None


def call_inputs(path: str, spec: Spec, layout: TorchLayout, variant: str, seed: int = 1):
    """The spec's global batch for `layout` and `variant`, under a fixed seed (`seed`: parity.steps asks each
    step's batch under a seed of its own); SpecError names what it broke."""
    import torch

    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            batch = spec.inputs(layout, variant)
    except Exception as exc:  # the user's function may raise anything
        raise SpecError(f"--spec {path!r}: inputs({layout.name!r}, {variant!r}) raised "
                        f"{type(exc).__name__}: {exc}") from exc
    problem = batch_problem(batch)
    if problem:
        raise SpecError(f"--spec {path!r}: inputs({layout.name!r}, {variant!r}) {problem}")
    return batch


def batch_problem(batch) -> str | None:
    """What is wrong with a batch's shape: a tensor, or a dict of forward kwargs holding at least one tensor."""
    import torch

    if isinstance(batch, torch.Tensor):
        return None if batch.dim() >= 1 else "returned a 0-d tensor: the batch must be on dim 0"
    if not isinstance(batch, dict):
        return f"must return a tensor or a dict of forward kwargs, got {type(batch).__name__}"
    bad = [k for k in batch if not isinstance(k, str)]
    if bad:
        return f"returned a dict with non-string keys {bad!r:.80}"
    if not any(isinstance(v, torch.Tensor) for v in batch.values()):
        return "returned a dict with no tensor in it"
    return None


def split_problem(batch, layout: TorchLayout) -> str | None:
    """Why the batch does not split into `layout.dp_degree` equal shards on dim 0; None when it does."""
    import torch

    degree = layout.dp_degree
    tensors = batch.items() if isinstance(batch, dict) else [("input", batch)]
    for name, value in tensors:
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] % degree:
            return f"{name}: batch {value.shape[0]} does not split into dp x fsdp = {degree} equal shards"
    return None
