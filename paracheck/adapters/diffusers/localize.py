"""The diffusers adapter's forward localization: a failing case's passes rerun with hooks, shards gathered by the plan.

After a case's checks, every rank learns (one all-reduce) whether `parity.forward` or `parity.inference` failed
on any rank; if so, every rank reruns the failing pass on the same model, with the same inputs, recording each
module call (`checks.localize.Recorder`), and the reference model does the same. The parallel side's tensors are
put back together by the layout's groups: over the TP group along the colwise output dim (or the heads), over
the CP group along the `_cp_plan`'s split dims; the plan's gather points (`ContextParallelOutput` entries) and
the root are compared as the rank holds them, so a gather that did not happen shows there. The finding goes into
the failing check's `data["localization"]["forward"]`. Gradient tables are built by `checks.check_grads`.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from paracheck.adapters.diffusers import library, reference
from paracheck.checks import localize, rerun, unread
from paracheck.domain.localization import ForwardLocalization, GradsLocalization
from paracheck.domain.records import CheckId, CheckResult

#: The dims a TP-split module output is read on first: colwise projections split the last dim, and the
#: processors' per-head tensors ([batch, seq, heads, dim]) split the heads.
TP_DIMS = (-1, 2)


def after_checks(ctx, inputs: dict, checks: list[CheckResult], result) -> None:
    """The adapter's hook-in, called on every rank after every check of a case: localize the failing passes.
    Every rank joins (the parallel model's collectives need all of them), whether its own checks passed:
    one all-reduce of the failure flags decides for all."""
    if not localize.enabled():
        return
    by_id, failed = rerun.failed(checks, (ctx.forward_error or ctx.inference_error, ctx.backward_error))
    forward_raised, backward_raised = failed.extra
    if forward_raised or not (failed.passes or failed.grads):
        return  # a pass that raised cannot be rerun to a trace, and a passing case needs none
    try:
        ref_calls, _ = rerun.record(ctx.reference, lambda m: reference.forward(m, inputs))
        for check_id, grad in failed.passes:
            rerun.attach(by_id, check_id, forward(ctx, inputs, ref_calls, grad))
        if failed.grads and not (failed.forward or backward_raised):
            # The forward agrees, so the gradient went wrong on the way back: trace the backward the same way.
            trace = backward(ctx, inputs, ref_calls)
            found = GradsLocalization(backward=trace)
            if trace.origin:
                found = replace(found, origin=trace.origin, origin_from="backward trace")
            rerun.attach(by_id, CheckId.GRADS, found, merge=True)
    except Exception as exc:  # a diagnosis that breaks must not turn a failing case into an error
        rerun.attach_error(by_id, exc)


def forward(ctx, inputs: dict, ref_calls: list, grad: bool) -> ForwardLocalization:
    """One pass rerun on the parallel model with hooks, its trace gathered and compared (collective)."""
    calls, out = rerun.record(ctx.model, lambda m: reference.forward(m, inputs), grad, local=localize.local_share)
    before = ctx.out if grad else ctx.inference_out
    found = rerun.traced(calls, ref_calls, groups(ctx, ref_calls), whole(ctx.model), ctx.atol, ctx.rtol,
                         rerun.pass_name(grad))
    return replace(found, reproduced=before is not None and bool(torch.equal(out.detach(), before.detach())))


def backward(ctx, inputs: dict, forward_calls: list) -> ForwardLocalization:
    """The training pass and its backward rerun on both models with backward hooks: each module's received
    and passed-on gradients, in backward order, gathered and compared like a forward trace (`forward_calls`:
    the reference's forward trace, whose shapes tell the joint sequences apart). A module output
    the loss does not read is read by it as an exact zero (`checks.unread`: a full backward hook would hand
    it a zero of its own, which a DTensor op behind it cannot take). Both models' parameter gradients are put
    back as they were (the reference is kept for the next case)."""
    def plain(model):
        out = reference.forward(model, inputs)
        return (out * ctx.weights.to(out.dtype)).sum()

    unused = unread.unused_outputs(ctx.reference, plain)

    def loss(model):
        with unread.returned(model, unused) as held:
            value = plain(model)
        return unread.read_by(value, held)

    ref_calls = rerun.record_backward(ctx.reference, loss)
    calls = rerun.record_backward(ctx.model, loss, local=localize.local_share)
    return rerun.traced(calls, ref_calls, groups(ctx, forward_calls), set(), ctx.atol, ctx.rtol, "backward",
                        partial=True)


def groups(ctx, ref_calls: list) -> list[localize.Group]:
    """The layout's groups a module output may be split over: TP first (a TP x CP tensor is gathered over
    TP, then over CP), each with this rank's process group and the dims to read a split on first; for CP,
    the per-rank lengths of what the plan splits (`split_lengths`)."""
    layout, applied, out = ctx.layout, ctx.applied, []
    if layout.has_tp:
        out.append(localize.Group("tp", tuple(map(tuple, layout.groups(("tp",)))),
                                  applied.meshes["tp"].get_group(), TP_DIMS, packed_lengths(ctx.reference, layout.tp)))
    if layout.has_cp:
        mesh = library.cp_flattened_mesh(applied.parallel_config.context_parallel_config)
        out.append(localize.Group("cp", tuple(map(tuple, layout.groups(("ring", "ulysses")))), mesh.get_group(),
                                  cp_dims(ctx.model), split_lengths(ctx.model, ref_calls, layout.cp)))
    return out


def split_lengths(model, ref_calls: list, cp: int) -> tuple:
    """Per-rank lengths of the inputs the `_cp_plan` splits (read from the reference's calls of the modules
    it names): a joint sequence is one of these per rank, laid end to end."""
    from paracheck.adapters.diffusers.splits import plan_modules

    names = {id(m): (n or "<root>") for n, m in model.named_modules()}
    first = {}
    for call in ref_calls:
        first.setdefault(call.name, call)
    lengths = []
    for module_id, entry in (getattr(model, "_cp_plan", None) or {}).items():
        if not isinstance(entry, dict):
            continue
        for module in plan_modules(model, module_id):
            call = first.get(names.get(id(module)))
            for arg, spec in entry.items():
                if call is None or getattr(spec, "split_output", False) or str(arg) not in call.input_names:
                    continue
                shape = call.inputs[call.input_names.index(str(arg))].shape
                if len(shape) != getattr(spec, "expected_dims", len(shape)) or len(shape) <= spec.split_dim:
                    continue  # diffusers leaves an input of another rank unsplit (Wan's 1-D timestep)
                size = shape[spec.split_dim]
                if size % cp == 0:
                    lengths.append(size // cp)
    return tuple(dict.fromkeys(lengths))


def packed_lengths(model, tp: int) -> tuple:
    """Per-rank lengths of the blocks a packed TP parameter is sharded in (the library's own shard specs): a
    packed projection's input or output holds one shard of each block, laid end to end."""
    orders = []
    for spec in library.tp_shard_specs(model, tp).values():
        if spec.dim is not None and len(spec.block_sizes or ()) > 1 and all(b % tp == 0 for b in spec.block_sizes):
            orders.append(tuple(b // tp for b in spec.block_sizes))
    return tuple(dict.fromkeys(orders))


def cp_dims(model) -> tuple:
    """The dims the model's `_cp_plan` splits and gathers on, in plan order."""
    dims = []
    for entry in (getattr(model, "_cp_plan", None) or {}).values():
        specs = entry.values() if isinstance(entry, dict) else [entry]
        for spec in specs:
            for attr in ("split_dim", "gather_dim"):
                if isinstance(getattr(spec, attr, None), int):
                    dims.append(getattr(spec, attr))
    return tuple(dict.fromkeys(dims))


def whole(model) -> set:
    """Module names whose outputs the plan keeps whole on every rank: the root and the `_cp_plan`'s gather
    points (`*` expanded over a ModuleList)."""
    from paracheck.adapters.diffusers.splits import plan_modules

    names = {id(m): (n or "<root>") for n, m in model.named_modules()}
    out = {"<root>"}
    for module_id, entry in (getattr(model, "_cp_plan", None) or {}).items():
        if not isinstance(entry, dict):
            out.update(names[id(m)] for m in plan_modules(model, module_id) if id(m) in names)
    return out
