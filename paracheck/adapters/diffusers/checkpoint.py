"""`checkpoint.roundtrip` for a diffusers model: the library's own `save_pretrained` from the parallel model (after
`enable_parallelism`, and after `parity.steps` where it ran), its own `from_pretrained` on one device, and every
tensor of the loaded model equal to the parallel model's, gathered whole by the kit.

Every rank saves (each into a directory of its own under the case's workdir, so no two ranks write one file and
each rank's own state is what is judged) and loads what it saved. Where diffusers declines (a
`NotImplementedError`: 0.42 refuses to save a TP-sharded model, "Save the model before sharding it instead"), the
check is a SKIP in the library's words, naming the entry point; any other raise is a FAIL. The directories are
removed, also when a step raises.
"""

from __future__ import annotations

import os
import shutil

import torch.distributed as dist

from paracheck.adapters.diffusers import library
from paracheck.adapters.diffusers.steps import whole_params
from paracheck.checks.compare import compare_named
from paracheck.checks.shards import full
from paracheck.domain.records import CheckId, CheckResult, Failure, Status


def expected_state(body) -> dict:
    """What a whole checkpoint of the parallel model holds: every parameter whole (TP shards joined by the plan's
    blocks) and every persistent buffer, on the CPU."""
    model, applied = body.model, body.checks.applied
    specs = library.tp_shard_specs(body.ref.model, applied.layout.tp) if applied.layout.has_tp else {}
    state = whole_params(model, specs, applied)
    for name, value in model.state_dict().items():
        if name not in state:
            state[name] = full(value).detach().cpu()
    return state


def run(body) -> list[CheckResult]:
    expected = expected_state(body)
    folder = os.path.join(body.ctx.site.workdir, f"save_pretrained-rank{dist.get_rank()}")
    try:
        return [_roundtrip(body, folder, expected)]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _roundtrip(body, folder: str, expected: dict) -> CheckResult:
    try:
        body.model.save_pretrained(folder, is_main_process=True, safe_serialization=True)
    except Exception as exc:
        return _refused("save_pretrained", exc, body)
    try:
        loaded = type(body.model).from_pretrained(folder, torch_dtype=body.ref.out.dtype).eval()
    except Exception as exc:
        return _refused("from_pretrained", exc, body)
    return _judge(loaded.state_dict(), expected)


def _refused(entry: str, exc: Exception, body) -> CheckResult:
    """A `NotImplementedError` is the library declining (diffusers 0.42 raises one from `save_pretrained` for a
    TP-sharded model: "... is sharded with tensor parallelism, so it cannot be saved yet"): a SKIP in its words.
    Anything else it raises is a failure of the round trip, typed."""
    route = body.checks.applied.route.value
    words = f"diffusers' {entry} (after the {route} route's parallelism) raised {type(exc).__name__}: " \
            f"{(str(exc).splitlines() or [''])[0][:300]}"
    data = {"entry_point": entry, "exception": type(exc).__name__}
    if isinstance(exc, NotImplementedError):
        return CheckResult(CheckId.CHECKPOINT, Status.SKIP, words, data=data)
    return CheckResult(CheckId.CHECKPOINT, Status.FAIL, words, data=data, failure=Failure.raised(exc, CheckId.CHECKPOINT))


def _judge(loaded: dict, expected: dict) -> CheckResult:
    """Held to equality (atol = rtol = 0): a save and load moves no bit."""
    held = compare_named(CheckId.CHECKPOINT, {n: t.detach().cpu() for n, t in loaded.items()}, expected, 0.0, 0.0)
    differ = [f"{name} (max_abs {size:.2e})" if size != float("inf") else detail for size, name, detail in held.failing]
    missing, extra = held.missing, held.extra
    problems = ([f"missing {missing[:3]}"] if missing else []) + ([f"unexpected {extra[:3]}"] if extra else [])
    if differ:
        problems.append(f"{len(differ)} tensor(s) differ: {'; '.join(differ[:3])}")
    data = {"tensors": len(expected), "differ": len(differ)}
    if problems:
        return CheckResult(CheckId.CHECKPOINT, Status.FAIL, "save_pretrained then from_pretrained on one device: "
                           + "; ".join(problems), data=data)
    return CheckResult(CheckId.CHECKPOINT, Status.PASS, f"save_pretrained then from_pretrained on one device: "
                       f"{len(expected)} tensors equal", data=data)
