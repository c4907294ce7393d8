"""A failing case's passes rerun with hooks on every rank, and the finding attached to its check: the steps every
adapter's localization takes (`checks.localize` traces, gathers and compares).

Every rank learns in one all-reduce which parity checks failed on any rank (`failed`), so all of them rerun the
same passes and join the same collectives; each pass is recorded on a model (`record`, `record_backward`) and
held to the reference's trace (`traced`); the finding goes into the failing check's
`data["localization"][part]` (`attach`), or, when the diagnosis itself raised, what it raised (`attach_error`):
a diagnosis that breaks must not turn a failing case into an error. A backward rerun whose model has an output
the loss never reads reads it as an exact zero first (`checks.unread`).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace

import torch

from paracheck.checks import localize
from paracheck.domain.localization import ForwardLocalization, GradsLocalization
from paracheck.domain.records import CheckId, CheckResult, Status

#: The parity checks a localization answers, and the part of `data["localization"]` each one's finding is.
PARTS = {CheckId.FORWARD: "forward", CheckId.INFERENCE: "forward", CheckId.GRADS: "grads"}
#: The record each part is.
RECORDS = {"forward": ForwardLocalization, "grads": GradsLocalization}


@dataclass(frozen=True)
class Failed:
    """Which parity checks failed on any rank, and the adapter's own flags (`extra`, in the order it gave them)."""
    forward: bool
    inference: bool
    grads: bool
    extra: tuple = ()

    @property
    def passes(self) -> list[tuple[CheckId, bool]]:
        """(check, whether its pass takes gradients) for each failing forward pass, the training one first."""
        return [(c, grad) for c, failed, grad in ((CheckId.FORWARD, self.forward, True),
                                                   (CheckId.INFERENCE, self.inference, False)) if failed]


def failed(checks: list[CheckResult], extra: tuple = ()) -> tuple[dict, Failed]:
    """The checks by id, and which failed on any rank: one all-reduce (MAX) of the flags, on every rank, whether
    its own checks passed. `extra`: the adapter's own per-rank flags (a pass that raised here), reduced alike."""
    import torch.distributed as dist

    by_id = {c.id: c for c in checks}
    flags = torch.tensor([float(by_id.get(i) is not None and by_id[i].status == Status.FAIL) for i in PARTS]
                         + [float(bool(f)) for f in extra])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    forward, inference, grads, *rest = (bool(f > 0) for f in flags)
    return by_id, Failed(forward, inference, grads, tuple(rest))


def attach(by_id: dict, check_id: CheckId, found, merge: bool = False) -> None:
    """`found` (a localization record) as the localization of `check_id`, written as JSON into its data (merged
    into what it holds with `merge`: the fields `found` sets replace the held ones, as a backward trace's origin
    does the gradient table's)."""
    check = by_id.get(check_id)
    if check is None:
        return
    held = check.data.setdefault("localization", {})
    part = PARTS[check_id]
    held[part] = (overlay(type(found).from_json(held[part]), found) if merge and part in held else found).to_json()


def overlay(base, top):
    """`base` with every field `top` sets (not at its default) taken from `top` (pure)."""
    return replace(base, **{f.name: getattr(top, f.name) for f in fields(top) if getattr(top, f.name) != f.default})


def attach_error(by_id: dict, exc: Exception, ids=tuple(PARTS)) -> None:
    """What the diagnosis raised, as the localization of each failing check of `ids`."""
    for check_id in ids:
        if check_id in by_id and by_id[check_id].status == Status.FAIL:
            attach(by_id, check_id, RECORDS[PARTS[check_id]](error=raised(exc)), merge=True)


def raised(exc: Exception) -> str:
    """A localization's `error`: what the diagnosis raised."""
    return f"localization raised {type(exc).__name__}: {exc}"


def record(model, run, grad: bool = False, local=None, names: dict | None = None) -> tuple[list, object]:
    """`run(model)` with forward hooks on every module (`localize.Recorder`; `names`: which, under what names):
    its calls, and what it returned."""
    with torch.set_grad_enabled(grad), localize.Recorder(model, local=local, names=names) as recorder:
        out = run(model)
    return recorder.calls, out


def record_backward(model, loss, local=None, names: dict | None = None) -> list:
    """`loss(model)` and its backward with backward hooks on every module (`localize.BackwardRecorder`): each
    call's received and passed-on gradients. The model's parameter gradients are put back as they were (a
    backward adds into `.grad` in place, and a kept reference model serves the next case)."""
    with grads_kept(model), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "full backward hook is firing ... no inputs require gradients"
        with localize.BackwardRecorder(model, local=local, names=names) as recorder:
            loss(model).backward()
    return recorder.calls


@contextmanager
def grads_kept(model):
    """The parameters' gradients set aside while the block runs a backward, and put back after: a backward adds
    into `.grad` in place, so each starts from none (and the kept ones stay as the checks saw them)."""
    saved = {n: p.grad for n, p in model.named_parameters()}
    for param in model.parameters():
        param.grad = None
    try:
        yield
    finally:
        for name, param in model.named_parameters():
            param.grad = saved[name]


def traced(calls: list, ref_calls: list, groups: list, whole: set, atol: float, rtol: float, pass_name: str,
           partial: bool = False, declared: dict | None = None) -> ForwardLocalization:
    """One rerun pass's localization (collective: every rank gathers the same slots), named by `pass_name`
    ("training", "no_grad", "backward")."""
    import torch.distributed as dist

    found = localize.forward_localization(calls, ref_calls, groups, whole, atol, rtol, localize.all_gather_object,
                                          dist.get_rank(), partial=partial, declared=declared)
    return replace(found, pass_name=pass_name)


def pass_name(grad: bool) -> str:
    return "training" if grad else "no_grad"
