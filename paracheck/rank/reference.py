"""Single-device references: planned once per distinct model, fit, inputs and dtype, computed once per run.

A case's *plan* (fit, route, skip reason, reference key) is pure arithmetic every rank repeats. The
reference itself (weights, output, loss weights, gradients) is computed by one rank, when the first
case that needs it comes up, and written to the run directory as safetensors; every rank that needs it
reads it. Owners are dealt out round-robin over the keys, so the work spreads over the ranks (the
others wait for the file meanwhile). Each rank keeps the one reference it read last, for the next case
(often its control) to share; memory stays flat in the number of cases.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from dataclasses import dataclass, field

import torch

from paracheck.adapters.diffusers import attention
from paracheck.adapters.diffusers import library
from paracheck.domain.case import Case, FixtureUnavailable, call_factory
from paracheck.adapters.diffusers.fitting import Unfittable, cp_split_problems, fit_init_dict
from paracheck.domain.records import Failure, FailureKind, Route
from paracheck.adapters.diffusers.routes import resolve_route
from paracheck.launch.protocol import read_json, reference_error_file, reference_file, write_json

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


@dataclass
class Plan:
    """What every rank decides about a case before any collective, identically."""
    case: Case
    model_class: type | None = None
    init_dict: dict = field(default_factory=dict)
    inputs: dict = field(default_factory=dict)
    fit: list[str] = field(default_factory=list)
    route: Route | None = None
    skip: str | None = None
    #: The attention backend the case runs (`attention.choose`).
    attention: str | None = None
    #: The source or fitting raised (not a misfit): the case errors on every rank.
    error: str | None = None
    #: The skip's or the error's identity.
    failure: Failure | None = None
    key: str | None = None
    #: What the inputs carry that known failures can be keyed on (`input_traits`).
    traits: list[str] = field(default_factory=list)


def input_traits(inputs: dict) -> list[str]:
    """"mask" when an attention-mask input is given, "padded" when it also masks something out: what an
    upstream bug that lives in mask handling needs, whatever the variant or test class is called."""
    masks = [v for k, v in inputs.items() if "mask" in k and isinstance(v, torch.Tensor)]
    traits = ["mask"] if masks else []
    if any(bool((m == 0).any()) for m in masks):
        traits.append("padded")
    return traits


class Sources:
    """What a rank keeps between cases: each factory or payload, loaded once per process, and the
    reference it read last (`LastReference`)."""

    KEEP = 32

    def __init__(self):
        self._loaded: dict[tuple, tuple] = {}
        self.last_reference = LastReference()

    def get(self, case: Case):
        name = (case.payload or case.factory, case.variant, case.shape)
        if name not in self._loaded:
            if case.payload:
                from paracheck.pytest.payload import load

                self._loaded[name] = load(os.path.join(case.payload, case.variant))
            else:
                self._loaded[name] = call_factory(case.factory, case.variant, case.shape)
            if len(self._loaded) > self.KEEP:  # explore draws a new shape per case: keep the recent ones
                del self._loaded[next(iter(self._loaded))]
        return self._loaded[name]


def plan(case: Case, backend, sources: Sources) -> Plan:
    """Load the case's source, fit it, resolve its route; the same on every rank, no collective."""
    try:
        model_class, init_dict, inputs = sources.get(case)
    except FixtureUnavailable as exc:
        return Plan(case, skip=str(exc), failure=Failure(FailureKind.SKIP, exception=type(exc).__name__))
    except Exception as exc:
        return Plan(case, error=f"loading the model source raised {type(exc).__name__}: {exc}",
                    failure=Failure.raised(exc))
    p = Plan(case, model_class, inputs=inputs, traits=input_traits(inputs))
    try:
        options = dict(case.cp_options)
        refused = library.cp_options_refused(case.layout, case.cp_options)
        if refused:
            raise Unfittable(refused)
        fit = fit_init_dict(model_class, init_dict, case.layout, any_heads=bool(options.get("ulysses_anything")))
        p.init_dict, p.fit = fit.init_dict, fit.changes
        uneven_ok = options.get("ulysses_anything") or options.get("ring_anything")
        problems = backend.problems(case.layout) + ([] if uneven_ok else
                                                    cp_split_problems(model_class, inputs, case.layout))
        if problems:
            raise Unfittable("; ".join(problems))
        p.route = resolve_route(case.route, case.layout)
        p.attention, refused = attention.choose(case.attention_backend, backend.device_type, case.layout)
        if refused:
            raise Unfittable(refused)
        if case.control:
            _control_fits(case, p)
    except Unfittable as exc:
        p.skip, p.failure = str(exc), exc.failure
        return p
    p.key = _key(case, model_class, p.init_dict, p.attention)
    return p


def _control_fits(case: Case, p: Plan) -> None:
    from paracheck.checks.controls import get_control

    control = get_control(case.control)
    reason = control.skip_reason(case.layout, p.route)
    if reason:
        raise Unfittable(reason)


def _key(case: Case, model_class: type, init_dict: dict, attention: str) -> str:
    source = case.payload or case.factory
    shape = case.shape.to_json() if case.shape else None
    text = json.dumps([source, f"{model_class.__module__}.{model_class.__qualname__}", init_dict, case.variant,
                       shape, case.dtype, case.grads, attention], sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


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


class Owners:
    """Which rank computes each reference: keys dealt out round-robin in the order cases need them
    (every rank sees the same order, so they agree without talking)."""

    def __init__(self, world: int):
        self.world, self._order = world, {}

    def owner(self, key: str) -> int:
        self._order.setdefault(key, len(self._order))
        return self._order[key] % self.world


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
        self._key, self._ref = None, None

    def get(self, p: Plan, refs_dir: str, device: torch.device) -> Reference:
        if p.key != self._key:
            self._key, self._ref = None, None
            self._ref = load(p, refs_dir, device)
            self._key = p.key
        return self._ref


#: torch.nn.init's random initializers. A module's __init__ draws its weights with them; a copy of a model
#: whose weights we hold has them overwritten in full right after, so it need not draw them first.
_RANDOM_INITS = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                 "xavier_normal_", "orthogonal_", "sparse_")


def copy_of(model_class: type, init_dict: dict, state: dict, device: torch.device, dtype: torch.dtype):
    """`model_class(**init_dict)` in eval mode on `device` in `dtype`, holding `state` (load_state_dict is
    strict: every parameter and persistent buffer comes from `state`). The same model as constructing
    and loading gives, without drawing random weights only to overwrite them: buffers outside the state
    (rotary tables) are computed in __init__ as always, and deterministic initializers still run."""
    with _undrawn():
        model = model_class(**init_dict).eval()
    if not _placed(model, device, dtype):
        model = model.to(device, dtype)
    model.load_state_dict(state)
    return model


def _placed(model, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `model.to(device, dtype)` would change nothing: it casts floating and complex tensors
    only. Skipping it spares a walk over every module and diffusers' warning about fp32 modules."""
    return all(t.device == device and (t.dtype == dtype or not (t.is_floating_point() or t.is_complex()))
               for t in (*model.parameters(), *model.buffers()))


@contextlib.contextmanager
def _undrawn():
    """Inside: torch.nn.init's random initializers leave their tensor as it is; restored on exit, also on error."""
    from torch.nn import init

    saved = {name: getattr(init, name) for name in _RANDOM_INITS if hasattr(init, name)}
    for name in saved:
        setattr(init, name, _unchanged)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(init, name, fn)


def _unchanged(tensor, *args, **kwargs):
    return tensor
