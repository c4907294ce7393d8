"""The torch adapter's localization: a failing forward rerun with hooks on the user's module and on the reference,
each module's tensors put back together by the placements the spec's parallelize declared.

After a case's checks, every rank learns (one all-reduce, `checks.rerun.failed`) whether `parity.forward` or
`parity.inference` failed on any rank; if so, both models rerun that pass on this rank's shard of the batch
(the data-parallel ranks hold whole activations of their own shard), recording every module call. A DTensor is
taken whole (`full_tensor()`, a collective every rank reaches in the same hook). A plain tensor is a local
shard where a TP style left one: its placements are read from the hooks torch's styles installed on the module
(`placements`: ColwiseParallel's `Shard(-1)`, RowwiseParallel's `output_layouts`, a PrepareModuleInput or
PrepareModuleOutput with `use_local_output`), and the module's tensor is gathered over the TP group along the
declared dim; a module no style covers (a block, the attention around its projections) is read by its shapes,
the declared dims first. A local `Partial` is compared as held (the sum the next module was handed). The root's
output is compared as held, as `parity.forward` compares it. A call on one side only, or a tensor no reading puts
back together, is listed in `not_compared`. Only the TP group is gathered: a context-parallel split is the
spec's own, inside its forward, so such a tensor is listed as not compared. `parity.grads` carries its gradient
table itself (`checks.grads`).
"""

from __future__ import annotations

import functools
import inspect
from collections import Counter
from contextlib import contextmanager

from paracheck.adapters.torch import names
from paracheck.adapters.torch.batches import call
from paracheck.checks import localize, rerun
from paracheck.checks.shards import full
from paracheck.domain.records import CheckId

#: The modules whose outputs are compared as the rank holds them.
WHOLE = {"<root>"}


def after_checks(body, checks: list) -> None:
    """The adapter's hook-in, on every rank after a case's checks: localize a failing forward (every rank joins)."""
    if not localize.enabled():
        return
    by_id, failed = rerun.failed(checks)
    if not failed.passes:
        return
    try:
        def run(model):
            return call(model, body.mine)

        with eager():
            ref_calls, _ = rerun.record(body.ref_model, run, names=names.hooked(body.ref_model))
            declared = placements(body.model)
            tp = groups(body.mesh, body.layout, declared)
            for check_id, grad in failed.passes:
                calls, _ = rerun.record(body.model, run, grad, local=full, names=names.hooked(body.model))
                rerun.attach(by_id, check_id, rerun.traced(calls, ref_calls, tp, WHOLE, body.atol, body.rtol,
                                                           rerun.pass_name(grad), declared=declared))
    except Exception as exc:  # a diagnosis that breaks must not turn a failing case into an error
        rerun.attach_error(by_id, exc, (CheckId.FORWARD, CheckId.INFERENCE))


def groups(mesh, layout, declared: dict) -> list[localize.Group]:
    """The TP group, read off the spec's mesh (its partition in the mesh's own order), the dims the plan
    declares splits on read first."""
    if layout.tp == 1 or "tp" not in (mesh.mesh_dim_names or ()):
        return []
    index = mesh.mesh_dim_names.index("tp")
    partition = tuple(tuple(row) for row in mesh.mesh.movedim(index, -1).reshape(-1, layout.tp).tolist())
    return [localize.Group("tp", partition, mesh.get_group("tp"), preferred(declared, "tp"))]


def preferred(declared: dict, label: str) -> tuple:
    """The dims the plan splits on along `label`, the most declared first (pure)."""
    counts = Counter(d.get(label) for tensors in declared.values() for d in tensors if d.get(label) is not None)
    return tuple(dim for dim, _ in counts.most_common())


@contextmanager
def eager():
    """Compiled modules run as their eager code while the block runs (`torch.compiler.set_stance`): the hooks
    localization records with fire on every module inside a compiled block, as dynamo would trace them away. A
    compiled model's rerun is then its eager code: a difference that only compiling makes reads as none."""
    import torch

    with torch.compiler.set_stance("force_eager"):
        yield


# -- what the spec's plan declares -----------------------------------------------------------------


def placements(model) -> dict:
    """(module name, "in"|"out") -> per tensor, {mesh dim name: the dim it is split on, or None for whole}: the
    local tensors a TP style leaves a module's inputs or outputs as (`gather_trace`'s `declared`). Only a style
    that hands on local tensors declares; one that hands on DTensors needs none (they are taken whole)."""
    out = {}
    recorded = names.hooked(model)
    for raw, module in model.named_modules():
        for side, hooks in (("in", module._forward_pre_hooks), ("out", module._forward_hooks)):
            for hook in hooks.values():
                found = declared_by(hook, side)
                if found is not None and raw in recorded:
                    out[(recorded[raw] or "<root>", side)] = found
    return out


def declared_by(hook, side: str) -> list | None:
    """What one hook declares (see `placements`), or None: no TP style's, or one that hands on DTensors. torch's
    styles install closures over the style (PrepareModuleInput, PrepareModuleOutput) or over a partial of their
    static preparing function (Colwise, Rowwise, SequenceParallel), and the 1-D mesh they run on."""
    from torch.distributed.device_mesh import DeviceMesh

    cells = [c.cell_contents for c in getattr(hook, "__closure__", None) or ()]
    mesh = next((c for c in cells if isinstance(c, DeviceMesh)), None)
    if mesh is None or mesh.ndim != 1 or not mesh.mesh_dim_names:
        return None
    args = style_arguments(cells)
    layouts = args.get("desired_output_layouts", args.get("output_layouts")) if side == "out" \
        else args.get("desired_input_layouts")
    if args.get("use_local_output") is not True or layouts is None:
        return None
    label = mesh.mesh_dim_names[0]
    return [split_of(p, label) for p in (layouts if isinstance(layouts, (tuple, list)) else (layouts,))]


def style_arguments(cells: list) -> dict:
    """The settings a style's hook runs with, by name: the style's own attributes, or the arguments its partial
    binds."""
    from torch.distributed.tensor.parallel import ParallelStyle

    for cell in cells:
        if isinstance(cell, ParallelStyle):
            return vars(cell)
        if isinstance(cell, functools.partial):
            owner = getattr(cell.func, "__self__", None)
            if isinstance(owner, ParallelStyle):
                return vars(owner)
            try:
                return dict(inspect.signature(cell.func).bind_partial(*cell.args, **cell.keywords).arguments)
            except (TypeError, ValueError):
                return {}
    return {}


def split_of(placement, label: str) -> dict:
    """One tensor's declared reading: Shard(d) is split on d; Replicate and Partial are held whole (a local
    Partial is the partial sum the next module is handed, compared as it is); no placement declares nothing."""
    if placement is None:
        return {}
    dim = getattr(placement, "dim", None) if placement.is_shard() else None
    return {label: dim}
