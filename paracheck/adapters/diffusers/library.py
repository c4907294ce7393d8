"""The adapter to diffusers' internals: every private attribute paracheck reads or bends lives here.

When a diffusers release renames one, this module and `tests/adapters/diffusers/test_library.py` change, nothing else.
Three kinds of access: reading the parallel state the library built (meshes, hooks, processor configs,
TP shard specs), building that state for the composed route the library does not offer, and the scoped
CPU shims gloo runs need. Every shim is a `with` block that restores what it changed, also on error.
"""

from __future__ import annotations

import contextlib
import logging

#: The diffusers releases the kit's tests run on (tox.ini has an environment for each); the requirement
#: admits later ones, development versions included, as long as `missing()` finds every name below.
TESTED = ("0.41.0", "0.42.0", "0.42.1")
SUPPORTED = "diffusers >= 0.41.0 (tested: " + ", ".join(TESTED) + ")"
#: Every module-level diffusers name this adapter reads or bends.
PRIVATES = (
    ("diffusers.models._modeling_parallel", ("ParallelConfig", "ContextParallelConfig", "TensorParallelConfig")),
    ("diffusers.hooks.context_parallel", ("apply_context_parallel",)),
    ("diffusers.hooks.tensor_parallel", ("apply_tensor_parallel", "resolve_tp_shard_specs", "_SUPPORTED_TP_DEVICES")),
    ("diffusers.models.attention_dispatch", ("_AttentionBackendRegistry", "AttentionBackendName", "attention_backend",
                                             "_check_attention_backend_requirements",
                                             "_templated_context_parallel_attention", "funcol")),
    ("diffusers.models.modeling_utils", ("ModelMixin", "ModelMixin.enable_parallelism")),
)


def installed_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("diffusers")
    except PackageNotFoundError:
        return None


def missing() -> list[str]:
    """The names of `PRIVATES` the installed diffusers lacks (imports it); a dotted name is an attribute path."""
    import importlib

    absent = []
    for module_name, names in PRIVATES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            absent.append(module_name)
            continue
        absent += [f"{module_name}.{n}" for n in names if not _has_path(module, n)]
    return absent


def _has_path(obj, dotted: str) -> bool:
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def unsupported() -> str | None:
    """One line saying why the installed diffusers cannot be served, or None. A tested release is taken
    as it is (tests/adapters/diffusers/test_library.py pins its privates); any other is checked name by name."""
    version = installed_version()
    if version is None:
        return f"diffusers is not installed; paracheck needs {SUPPORTED}"
    if version in TESTED:
        return None
    absent = missing()
    if not absent:
        return None
    return f"diffusers {version} lacks {', '.join(absent)}; paracheck supports {SUPPORTED}"


#: Hook-name prefixes of diffusers' context-parallel hooks (`cp_input---<module id>`).
CP_INPUT = "cp_input---"
CP_OUTPUT = "cp_output---"
#: The logger whose warnings say an input was left unsplit.
CP_LOGGER = "diffusers.hooks.context_parallel"


def cp_hook_name(module_id: str, is_input: bool) -> str:
    return f"{CP_INPUT if is_input else CP_OUTPUT}{module_id}"


# -- reading the library's parallel state --------------------------------------------------------


def parallel_config(model):
    return getattr(model, "_parallel_config", None)


def cp_flattened_mesh(cp_config):
    """The 1-D mesh the library's Ulysses/ring collectives use for the whole CP group."""
    return cp_config._flattened_mesh


def ulysses_mesh(cp_config):
    """The 1-D mesh the library's Ulysses all-to-alls use."""
    return cp_config._ulysses_mesh


def config_mesh(part_config):
    return part_config._mesh


def hook_names(module) -> list[str]:
    registry = getattr(module, "_diffusers_hook", None)
    return list(registry.hooks) if registry is not None else []


def remove_hooks(model, prefixes: tuple[str, ...]) -> None:
    for module in model.modules():
        registry = getattr(module, "_diffusers_hook", None)
        for name in [n for n in (registry.hooks if registry else {}) if n.startswith(prefixes)]:
            registry.remove_hook(name)


def attention_processors(model) -> list[tuple[str, object]]:
    """Attention processors that take a parallel config (they have a `_parallel_config` slot)."""
    found = []
    for name, module in model.named_modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_parallel_config"):
            found.append((name, processor))
    return found


def set_processor_config(model, config) -> None:
    for _, processor in attention_processors(model):
        processor._parallel_config = config


def processor_config(processor):
    return processor._parallel_config


def tp_shard_specs(model, tp_degree: int) -> dict:
    """The library's own reading of `_tp_plan`: parameter name -> shard spec (dim, block sizes)."""
    from diffusers.hooks.tensor_parallel import resolve_tp_shard_specs

    return resolve_tp_shard_specs(model, model._tp_plan, tp_degree)


# -- building parallel state ---------------------------------------------------------------------


def make_parallel_config(layout, cp_options: tuple = (), cp_mesh=None, tp_mesh=None):
    """The library's `ParallelConfig` for `layout`; raises ValueError where the library refuses it. Given
    meshes, the library uses them instead of building its own (it would build one per call)."""
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig, TensorParallelConfig

    cp = ContextParallelConfig(ring_degree=layout.ring, ulysses_degree=layout.ulysses, mesh=cp_mesh,
                               **dict(cp_options)) if layout.has_cp else None
    tp = TensorParallelConfig(tp_degree=layout.tp, mesh=tp_mesh) if layout.has_tp else None
    return ParallelConfig(context_parallel_config=cp, tensor_parallel_config=tp)


def cp_options_refused(layout, cp_options: tuple) -> str | None:
    """The library's own words refusing these context-parallel options on `layout`; None when it takes them."""
    from diffusers.models._modeling_parallel import ContextParallelConfig

    from paracheck.domain.case import options_text

    if not layout.has_cp or not cp_options:
        return None
    try:
        ContextParallelConfig(ring_degree=layout.ring, ulysses_degree=layout.ulysses, **dict(cp_options))
    except (ValueError, NotImplementedError, TypeError) as exc:
        return f"diffusers refuses {options_text(cp_options)} on {layout}: {exc}"
    return None


def library_accepts(layout) -> bool:
    """Whether the installed diffusers takes this layout in one `ParallelConfig`."""
    try:
        make_parallel_config(layout)
    except ValueError:
        return False
    return True


def composed_config(layout, mesh, rank: int, world: int, device, cp_options: tuple = ()):
    """A `ParallelConfig` holding both halves on one shared mesh, set up as `enable_parallelism` would.

    diffusers 0.42's constructor refuses TP and CP at once, so it is built with one half and given the
    other; each half gets the mesh (CP: the whole mesh; TP: its "tp" dimension) and its `setup`.
    """
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig, TensorParallelConfig

    cp = tp = None
    if layout.has_cp:
        cp = ContextParallelConfig(ring_degree=layout.ring, ulysses_degree=layout.ulysses, mesh=mesh,
                                   **dict(cp_options))
        cp.setup(rank, world, device, mesh)
    if layout.has_tp:
        tp = TensorParallelConfig(mesh=mesh["tp"])
        tp.setup(rank, world, device, mesh["tp"])
    config = ParallelConfig(context_parallel_config=cp) if cp else ParallelConfig(tensor_parallel_config=tp)
    config.context_parallel_config, config.tensor_parallel_config = cp, tp
    config._rank, config._world_size, config._device, config._mesh = rank, world, device, mesh
    return config


def attach(model, config) -> None:
    """Give a model (and its processors, with CP) the config the library's hooks will read."""
    model._parallel_config = config
    if config.context_parallel_config is not None:
        set_processor_config(model, config)


def apply_context_parallel(model, cp_config) -> None:
    from diffusers.hooks.context_parallel import apply_context_parallel as apply

    apply(model, cp_config, model._cp_plan)


def apply_tensor_parallel(model, tp_config) -> None:
    from diffusers.hooks.tensor_parallel import apply_tensor_parallel as apply

    apply(model, tp_config, model._tp_plan)


def shared_mesh(config):
    return getattr(config, "_mesh", None)


# -- attention backends --------------------------------------------------------------------------


def _attention_registry():
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    return _AttentionBackendRegistry


@contextlib.contextmanager
def active_attention_backend(name, fn):
    """Register `fn` under `name` (a str enum: the registry keys by member and reads `.value`) as a
    context-parallel capable backend and make it the active one, inside the block only; on exit, also
    on error or when nested, the registry is exactly as it was. Processors with an explicit
    `_attention_backend` do not consult the active backend."""
    registry = _attention_registry()
    missing = object()
    maps = {m: getattr(registry, m).get(name, missing) for m in ("_backends", "_constraints", "_supported_arg_names")}
    capable, active = name.value in registry._supports_context_parallel, registry._active_backend
    try:
        registry.register(name, constraints=[], supports_context_parallel=True)(fn)
        registry._active_backend = name
        yield name
    finally:
        for attr, value in maps.items():
            if value is missing:
                getattr(registry, attr).pop(name, None)
            else:
                getattr(registry, attr)[name] = value
        if not capable:
            registry._supports_context_parallel.discard(name.value)
        registry._active_backend = active


def attention_backend_problem(name: str) -> str | None:
    """Why the library cannot run attention backend `name` here; None when it can."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _check_attention_backend_requirements

    try:
        backend = AttentionBackendName(name)
    except ValueError:
        return f"not one of diffusers' attention backends ({', '.join(b.value for b in AttentionBackendName)})"
    if backend not in _attention_registry()._backends:
        return "not registered in this diffusers"
    try:
        _check_attention_backend_requirements(backend)
    except Exception as exc:  # the library says what is missing (a package, a version, a device)
        return f"{type(exc).__name__}: {exc}"
    return None


def observed_attention(observe):
    """Inside the block, every registered attention backend runs inside `observe(parallel_config)`, a
    context-manager factory given the config the call was dispatched with (None: a call on this rank's
    tensors alone). On exit, also on error, the registry holds the original functions again."""
    import functools

    def observed(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            with observe(kwargs.get("_parallel_config")):
                return fn(*args, **kwargs)
        return call

    return wrapped_backends(observed)


@contextlib.contextmanager
def wrapped_backends(wrap):
    """Inside the block, every registered attention backend function `fn` is called as `wrap(fn)`; on
    exit, also on error, the registry holds the original functions again."""
    backends = _attention_registry()._backends
    originals = dict(backends)
    backends.update({name: wrap(fn) for name, fn in originals.items()})
    try:
        yield
    finally:
        backends.update(originals)


@contextlib.contextmanager
def templated_ops(wrap):
    """Inside the block, the library's templated context-parallel machinery (ring, Ulysses, unified)
    runs every backend's op pair as `wrap(forward_op, backward_op)`; restored on exit, also on error.
    Backends look the machinery up at call time, so diffusers' own and the kit's are both reached."""
    import diffusers.models.attention_dispatch as dispatch

    original = dispatch._templated_context_parallel_attention

    def templated(*args, forward_op, backward_op, **kwargs):
        forward_op, backward_op = wrap(forward_op, backward_op)
        return original(*args, forward_op=forward_op, backward_op=backward_op, **kwargs)

    dispatch._templated_context_parallel_attention = templated
    try:
        yield
    finally:
        dispatch._templated_context_parallel_attention = original


def named_attention_backend(name: str):
    from diffusers.models.attention_dispatch import attention_backend

    return attention_backend(name)


def templated_context_parallel_attention(*args, **kwargs):
    """The library's ring / Ulysses / unified machinery around a backend's forward and backward ops."""
    from diffusers.models.attention_dispatch import _templated_context_parallel_attention

    return _templated_context_parallel_attention(*args, **kwargs)


@contextlib.contextmanager
def attention_collectives(wrap):
    """Inside the block, the attention dispatcher's functional collectives are `wrap(original)`."""
    import diffusers.models.attention_dispatch as dispatch

    original = dispatch.funcol
    dispatch.funcol = wrap(original)
    try:
        yield
    finally:
        dispatch.funcol = original


# -- CPU shims for gloo --------------------------------------------------------------------------
# diffusers 0.42 assumes an accelerator in exactly two places; on CPU both refuse before any parallel
# code runs. Each shim lifts one refusal inside a `with` block; tests/adapters/diffusers/test_library.py fails if diffusers
# changes under them.


@contextlib.contextmanager
def cpu_device_count():
    """`ModelMixin._resolve_parallel_config` picks `rank % torch.accelerator.device_count()`, a modulo
    by zero on CPU. Inside this block the count reads 1 when no accelerator exists, so the device is `cpu:0`."""
    import torch

    original = torch.accelerator.device_count
    if original() > 0:
        yield
        return
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = original


@contextlib.contextmanager
def cpu_tensor_parallel():
    """`apply_tensor_parallel` allows only accelerator device types; torch's DTensor runs on CPU meshes
    too, so inside this block `cpu` joins the allowlist."""
    import diffusers.hooks.tensor_parallel as tp

    original = tp._SUPPORTED_TP_DEVICES
    tp._SUPPORTED_TP_DEVICES = tuple(original) + ("cpu",)
    try:
        yield
    finally:
        tp._SUPPORTED_TP_DEVICES = original


#: What the `neuron-tp` route says it stood in for on a CPU world (`routes.Applied.stood_in`, the report's
#: stand-in lines); everything else of the path is the library's own.
NEURON_STOOD_IN = {
    "why": "diffusers' Neuron TP path (hooks/tensor_parallel_neuron.py) needs a Neuron device",
    "kit": ["the TP mesh's device type as apply_tensor_parallel's dispatch reads it ('neuron')",
            "torch.neuron.current_device() (answers the CPU)"],
    "library": ["apply_tensor_parallel", "_resolve_tp_plan", "resolve_tp_shard_specs", "_apply_tp_neuron",
                "_local_shard", "DTensor.from_local", "_hooks_only_styles", "parallelize_module"],
}


class NeuronPathNotReached(RuntimeError):
    """`apply_tensor_parallel` ran under the Neuron stand-in without dispatching to `_apply_tp_neuron`."""


class _ReadsAsNeuron:
    """A TP mesh as `apply_tensor_parallel`'s dispatch reads it: device type "neuron", all else the mesh's."""
    device_type = "neuron"

    def __init__(self, mesh):
        self.mesh = mesh

    def __getattr__(self, name):
        return getattr(self.mesh, name)

    def __repr__(self) -> str:
        return f"{self.mesh!r} (read as neuron)"


def neuron_tp_missing() -> str | None:
    """Why this diffusers has no Neuron TP path to run; None when it has one."""
    try:
        from diffusers.hooks.tensor_parallel_neuron import _apply_tp_neuron  # noqa: F401
    except ImportError as exc:
        return f"diffusers {installed_version()} has no Neuron tensor-parallel path ({exc})"
    return None


@contextlib.contextmanager
def neuron_tensor_parallel():
    """Inside: `apply_tensor_parallel` on a CPU mesh dispatches to diffusers' Neuron path (`_apply_tp_neuron`),
    which runs on the real CPU mesh with `torch.neuron.current_device()` answering the CPU. Only those two
    things are stood in; on exit, also on error, both are as they were. Raises `NeuronPathNotReached` when a
    TP application inside the block took another path, or none reached `apply_tensor_parallel`."""
    import diffusers.hooks.tensor_parallel as tp
    import diffusers.hooks.tensor_parallel_neuron as neuron

    original_apply, original_neuron, calls = tp.apply_tensor_parallel, neuron._apply_tp_neuron, {"tp": 0, "neuron": 0}

    def apply(model, config, tp_plan, weights_already_sharded=False):
        if weights_already_sharded:  # no dispatch: hooks alone, on the real mesh
            return original_apply(model, config, tp_plan, weights_already_sharded)
        calls["tp"] += 1
        mesh, config._mesh = config._mesh, _ReadsAsNeuron(config._mesh)
        try:
            return original_apply(model, config, tp_plan, weights_already_sharded)
        finally:
            config._mesh = mesh

    def apply_neuron(model, tp_mesh, groups, specs):
        calls["neuron"] += 1
        with torch_neuron_on_cpu():
            return original_neuron(model, tp_mesh.mesh if isinstance(tp_mesh, _ReadsAsNeuron) else tp_mesh,
                                   groups, specs)

    def missed() -> NeuronPathNotReached:
        return NeuronPathNotReached(f"apply_tensor_parallel ran {calls['tp']} time(s), _apply_tp_neuron "
                                    f"{calls['neuron']}")

    tp.apply_tensor_parallel, neuron._apply_tp_neuron = apply, apply_neuron
    try:
        yield
    except Exception as exc:
        # A miss can also fail on the way: the default path handed the stand-in mesh, which torch >= 2.15's
        # DTensor refuses ("Expected to find a valid mesh"); the miss is the finding, not torch's words.
        if calls["tp"] != calls["neuron"]:
            raise missed() from exc
        raise
    finally:
        tp.apply_tensor_parallel, neuron._apply_tp_neuron = original_apply, original_neuron
    # Neither called is a miss too: the TP was applied some other way, and would pass for the Neuron path.
    if calls["tp"] == 0 or calls["tp"] != calls["neuron"]:
        raise missed()


@contextlib.contextmanager
def torch_neuron_on_cpu():
    """Inside: `torch.neuron` is a namespace whose `current_device()` is the CPU (where torch has none of its
    own, as on every build without torch-neuronx); on exit, torch has no `neuron` again."""
    import types

    import torch

    if hasattr(torch, "neuron"):
        yield
        return
    torch.neuron = types.SimpleNamespace(current_device=lambda: torch.device("cpu"))
    try:
        yield
    finally:
        del torch.neuron


@contextlib.contextmanager
def gloo_uneven_all_gather():
    """diffusers' ulysses_anything / ring_anything gather shards of unequal length with `dist.all_gather`;
    NCCL takes unequal outputs, gloo refuses them. Inside this block such a gather pads every shard to the
    largest shape, gathers, and trims each piece back; equal gathers are untouched."""
    import torch
    import torch.distributed as dist

    original = dist.all_gather

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        shapes = {tuple(t.shape) for t in tensor_list} | {tuple(tensor.shape)}
        if len(shapes) == 1 or async_op:
            return original(tensor_list, tensor, group=group, async_op=async_op)
        big = tuple(max(s[d] for s in shapes) for d in range(tensor.dim()))
        padded = tensor.new_zeros(big)
        padded[tuple(slice(0, n) for n in tensor.shape)] = tensor
        pieces = [torch.empty_like(padded) for _ in tensor_list]
        original(pieces, padded, group=group)
        for out, piece in zip(tensor_list, pieces):
            out.copy_(piece[tuple(slice(0, n) for n in out.shape)])
        return None

    dist.all_gather = all_gather
    try:
        yield
    finally:
        dist.all_gather = original


@contextlib.contextmanager
def parallel_shims(device_type: str):
    """The shims the parallel forward and backward need on `device_type`; none off the CPU."""
    if device_type != "cpu":
        yield
        return
    with gloo_uneven_all_gather():
        yield


@contextlib.contextmanager
def shims(device_type: str):
    """The shims the library's parallel entry points need on `device_type`; none off the CPU."""
    if device_type != "cpu":
        yield
        return
    with cpu_device_count(), cpu_tensor_parallel():
        yield


class Findings(logging.Filter):
    """Collects the library's "split will not be applied" warnings on every rank, inside a `with`.

    diffusers filters non-zero ranks out at the logger, so this filter goes first in line. Inside the block
    the logger's `warning_once` is its plain `warning`: a plain `logging.Logger` has no `warning_once` (it
    would be an AttributeError), and the one transformers adds to every logger when imported warns once per
    process, so every case after the first would lose its findings.
    """

    def __init__(self):
        super().__init__()
        self.messages: list[str] = []
        self._logger = logging.getLogger(CP_LOGGER)
        self._own_warning_once = None

    def filter(self, record):
        message = record.getMessage()
        if record.levelno >= logging.WARNING and message not in self.messages:
            self.messages.append(message)
        return True

    def __enter__(self):
        self._logger.filters.insert(0, self)
        self._own_warning_once = self._logger.__dict__.get("warning_once")
        self._logger.warning_once = self._logger.warning
        return self

    def __exit__(self, *exc):
        self._logger.removeFilter(self)
        if self._own_warning_once is None:
            del self._logger.warning_once
        else:
            self._logger.warning_once = self._own_warning_once


class LibraryError(Exception):
    """An error raised inside one of the library's parallel entry points, with where it came from."""

    def __init__(self, entry_point: str, route: str, cause: BaseException):
        self.entry_point, self.route, self.cause = entry_point, route, cause
        super().__init__(f"diffusers' {entry_point} raised on route {route}: {type(cause).__name__}: {cause}")


@contextlib.contextmanager
def entry_point(name: str, route: str):
    """Name the library entry point (and route) in any error raised inside it."""
    try:
        yield
    except LibraryError:
        raise
    except Exception as exc:
        raise LibraryError(name, route, exc) from exc



def fbc_change_ratio(residual, previous):
    """The first-block cache's change ratio as diffusers computes it from the head block's residual and the one
    before (mean absolute change over mean absolute value): a 0-d tensor, on this rank's shard under CP."""
    return (residual - previous).abs().mean() / previous.abs().mean()


def first_block_cache_hooks(transformer) -> tuple:
    """The first-block cache's hooks on `transformer` (diffusers' private hook registry): (the head block's hook,
    the tail block, the tail block's hook). ValueError where the cache is not on."""
    from diffusers.hooks.first_block_cache import _FBC_BLOCK_HOOK, _FBC_LEADER_BLOCK_HOOK
    from diffusers.hooks.hooks import HookRegistry

    head = tail = None
    for module in transformer.modules():
        registry = getattr(module, "_diffusers_hook", None)
        if registry is None:
            continue
        if registry.get_hook(_FBC_LEADER_BLOCK_HOOK) is not None:
            head = registry.get_hook(_FBC_LEADER_BLOCK_HOOK)
        hook = registry.get_hook(_FBC_BLOCK_HOOK)
        if hook is not None and hook.is_tail:
            tail = (module, hook)
    if head is None or tail is None:
        raise ValueError(f"{type(transformer).__name__} carries no first-block cache ({HookRegistry.__name__})")
    return head, tail[0], tail[1]


# -- a local world (`--local-world`) --------------------------------------------------------------------------------

#: diffusers' functions whose Python differs between ranks, each run per rank in a local world (`world.regions`):
#: (module, attribute path, kind, why). Everything else of the library runs once for every rank under torch's
#: LocalTensorMode, where a per-rank value needed as one Python value raises (`world.localworld.RankDependent`).
PER_RANK = (
    ("diffusers.hooks.tensor_parallel", "_local_shard", "function",
     "slices a weight by this rank's TP coordinate (tp_mesh.get_local_rank())"),
    ("diffusers.hooks.tensor_parallel_neuron", "_local_shard", "function", "the same function, imported by name"),
    ("diffusers.hooks.context_parallel", "EquipartitionSharder.shard", "classmethod",
     "picks this rank's chunk: tensor.chunk(n)[dist.get_rank(group)]"),
    ("diffusers.hooks.context_parallel", "PartitionAnythingSharder.shard_anything", "classmethod",
     "picks this rank's split: tensor.tensor_split(n)[dist.get_rank(group)]"),
    ("diffusers.hooks.context_parallel", "AllGatherFunction", "apply",
     "its backward keeps this rank's chunk of the gradient (ctx.rank)"),
    ("diffusers.hooks.context_parallel", "AllGatherAnythingFunction", "apply",
     "its backward keeps this rank's split of the gradient (ctx.rank)"),
    ("diffusers.models.attention_dispatch", "TemplatedRingAttention", "apply",
     "indexes the gathered KV chunks by the ring rank; its backward rotates gradients with permute_tensor, "
     "whose split sizes compare ranks in Python"),
    ("diffusers.models.attention_dispatch", "TemplatedRingAnythingAttention", "apply",
     "the same for uneven lengths"),
)


def per_rank_regions():
    """Inside: the functions of `PER_RANK` run per rank under an enabled LocalTensorMode (elsewhere they are
    themselves); restored on exit, also on error."""
    from paracheck.world.regions import per_rank_functions

    return per_rank_functions(PER_RANK)
