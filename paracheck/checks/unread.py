"""Module outputs a loss never reads, read by it as exact zeros, so a backward with full backward hooks runs the
graph the plain backward runs.

A full backward hook on a module with an output the loss never reads (a joint block's text stream after the last
block that reads it) hands that output a zero gradient it makes itself, a plain tensor; the branch behind it then
runs backward with it, and a DTensor op there fails (DTensor's redistribute backward reads `_local_tensor`).
`unused_outputs` finds those outputs on a model without any hook in its graph; `returned` collects them as the
modules return them while a forward runs; `read_by` adds each one's empty slice, summed, to the loss: its value
and every parameter gradient are unchanged, and those outputs get their zero through the graph, as any gradient.
"""

from __future__ import annotations

from contextlib import contextmanager

from paracheck.checks import localize
from paracheck.checks.rerun import grads_kept


def unused_outputs(model, loss) -> dict[str, list[int]]:
    """module name -> the indices of its output tensors that require grad but get none in `loss(model)`'s backward
    (a block's text stream, after the last block that reads it), in any of its calls (reading a zero from one a
    call did use changes nothing). Found with tensor hooks, which add no node to the graph; the parameter
    gradients are put back as they were."""
    reached: dict[str, list] = {}

    def note(name):
        def hook(module, args, out):
            flags = []
            reached.setdefault(name, []).append(flags)
            for tensor in localize.tensors_of(out):
                flags.append(not tensor.requires_grad)
                if tensor.requires_grad:
                    tensor.register_hook(lambda grad, i=len(flags) - 1: flags.__setitem__(i, True))
        return hook

    handles = [m.register_forward_hook(note(n or "<root>")) for n, m in model.named_modules()]
    try:
        with grads_kept(model):
            loss(model).backward()
    finally:
        for handle in handles:
            handle.remove()
    unused = {name: sorted({i for flags in calls for i, hit in enumerate(flags) if not hit})
              for name, calls in reached.items()}
    return {name: indices for name, indices in unused.items() if indices}


@contextmanager
def returned(model, wanted: dict):
    """The tensors `wanted` names (module name -> indices of its output tensors), as each call of the module
    returned them to its caller, collected while the block runs. Taken around the module's whole call (its
    `_compiled_call_impl` slot), so after a full backward hook wrapped them, which a forward hook runs before."""
    held, patched = [], []
    for name, module in model.named_modules():
        indices = wanted.get(name or "<root>")
        if not indices or module._compiled_call_impl is not None:
            continue

        def call(*args, _module=module, _indices=indices, **kwargs):
            out = _module._call_impl(*args, **kwargs)
            tensors = localize.tensors_of(out)
            held.extend(tensors[i] for i in _indices if i < len(tensors) and tensors[i].requires_grad)
            return out

        module._compiled_call_impl = call
        patched.append(module)
    try:
        yield held
    finally:
        for module in patched:
            module._compiled_call_impl = None


def read_by(loss, held: list):
    """`loss` plus an exact zero read from every tensor in `held` (each one's empty slice, summed)."""
    from torch.distributed.tensor import DTensor

    for tensor in held:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        loss = loss + local.reshape(-1)[:0].sum()
    return loss
