"""The rank side: run many cases in one process group, and leave one JSON result per case and rank.

Started by the launcher (`python -m paracheck.worker RUNDIR`) with a FileStore rendezvous, or by
torchrun through `workers/spec_worker.py` with env:// rendezvous. Results go to files the launcher
owns, written atomically, so a rank that dies mid-write leaves no half-written report behind.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .backends import get_backend
from .case import Case, call_factory
from .checks import (
    CheckResult,
    check_cp_hooks,
    check_grads,
    check_mesh,
    check_processor_config,
    check_tp_shards,
    compare,
    tolerance,
)
from .controls import get_control
from .fitting import Unfittable, cp_split_problems, fit_init_dict
from .routes import apply, resolve_route

#: Exit code of a rank that stopped because its world may be broken mid-case; the launcher restarts.
WORLD_BROKEN = 4
_CP_LOGGER = "diffusers.hooks.context_parallel"


class WorldBroken(Exception):
    """A case raised after collectives began; peers may be stuck, so this process group is done."""


def write_json(path: str, data) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as handle:
        json.dump(data, handle, default=str)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


class Findings(logging.Filter):
    """Collects the library's "split will not be applied" warnings on every rank.

    diffusers filters non-zero ranks out at the logger, so this filter goes first in line. It also
    supplies `warning_once` where the installed logging lacks it (plain `logging.Logger` has none;
    transformers adds one when imported), which would otherwise turn the warning into an AttributeError.
    """

    def __init__(self):
        super().__init__()
        self.messages: list[str] = []
        self._logger = logging.getLogger(_CP_LOGGER)
        self._added_warning_once = False

    def filter(self, record):
        message = record.getMessage()
        if record.levelno >= logging.WARNING and message not in self.messages:
            self.messages.append(message)
        return True

    def __enter__(self):
        self._logger.filters.insert(0, self)
        if not hasattr(self._logger, "warning_once"):
            self._logger.warning_once = self._logger.warning
            self._added_warning_once = True
        return self

    def __exit__(self, *exc):
        self._logger.removeFilter(self)
        if self._added_warning_once:
            del self._logger.warning_once


def forward(model, inputs: dict):
    return model(**dict(inputs), return_dict=False)[0]


def load_source(case: Case):
    if case.payload:
        from .payload import load

        return load(case.payload)
    return call_factory(case.factory)


@dataclass
class Prepared:
    """What the parallel run is checked against: the fitted model's reference, built on one device."""
    model_class: type
    init_dict: dict
    inputs: dict
    route: str
    reference: torch.nn.Module
    ref_out: torch.Tensor
    weights: torch.Tensor
    atol: float
    rtol: float


def run_case(case: Case, backend, workdir: str) -> dict:
    started = time.time()
    result = {"case": case.id, "rank": dist.get_rank(), "status": "ok", "reason": "", "checks": [],
              "findings": [], "route": case.route, "fit": []}
    try:
        prepared = _prepare(case, backend, result)
        try:
            _run_parallel(case, backend, workdir, prepared, result)
        except Unfittable:
            raise
        except Exception:
            result["phase"] = "parallel"  # collectives began: peers may be stuck
            raise
    except Unfittable as exc:
        result.update(status="skip", reason=str(exc))
    except Exception as exc:
        result.update(status="error", reason=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
    result["seconds"] = round(time.time() - started, 3)
    return result


def _prepare(case: Case, backend, result: dict) -> Prepared:
    """Everything before the first collective; the same on every rank, so a raise here is everyone's."""
    model_class, init_dict, inputs = load_source(case)
    fit = fit_init_dict(model_class, init_dict, case.layout)
    result["fit"] = fit.changes
    problems = backend.problems(case.layout) + cp_split_problems(model_class, inputs, case.layout)
    if problems:
        raise Unfittable("; ".join(problems))
    route = result["route"] = resolve_route(case.route, case.layout)
    reason = case.control and get_control(case.control).skip_reason(case.layout, route)
    if reason:
        raise Unfittable(reason)
    torch.manual_seed(0)
    reference = model_class(**fit.init_dict).eval()
    try:
        ref_out = forward(reference, inputs)
    except Exception as exc:
        raise Unfittable(f"the fitted config ({', '.join(fit.changes) or 'unchanged'}) failed on one device: "
                         f"{type(exc).__name__}: {exc}") from exc
    weights = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(1234)).to(ref_out.dtype)
    if case.grads:
        (ref_out * weights).sum().backward()
    atol, rtol = tolerance(ref_out.dtype, backend.device_type)
    return Prepared(model_class, fit.init_dict, inputs, route, reference, ref_out, weights,
                    atol if case.atol is None else case.atol, rtol if case.rtol is None else case.rtol)


def _run_parallel(case: Case, backend, workdir: str, p: Prepared, result: dict) -> None:
    with Findings() as findings:
        model = p.model_class(**p.init_dict).eval()
        model.load_state_dict(p.reference.state_dict())
        model, applied = apply(p.route, model, case.layout, backend, case.control, p.reference, workdir)
        checks = [
            check_mesh(applied),
            check_cp_hooks(model, case.layout),
            check_processor_config(model, applied),
            check_tp_shards(model, p.reference, applied),
        ]
        out, raised = _attempt(lambda: forward(model, p.inputs), result)
    result["findings"] = [f"input not split on rank {result['rank']}: {m}" for m in findings.messages]
    if raised:
        checks.append(CheckResult("parity.forward", "fail", f"forward raised {raised}"))
        checks.append(CheckResult("parity.grads", "skip", "forward raised"))
    else:
        checks.append(compare("parity.forward", out, p.ref_out, p.atol, p.rtol))
        if not case.grads:
            checks.append(CheckResult("parity.grads", "skip", "--no-grads"))
        elif tuple(out.shape) != tuple(p.ref_out.shape):
            checks.append(CheckResult("parity.grads", "skip", "the output shape differs, so the loss cannot match"))
        else:
            _, raised = _attempt(lambda: (out * p.weights).sum().backward(), result)
            checks.append(CheckResult("parity.grads", "fail", f"backward raised {raised}") if raised
                          else check_grads(model, p.reference, applied, p.atol, p.rtol))
    result["checks"] = [c.to_json() for c in checks]
    if raised and not case.control:
        # A control may raise once its bug is planted; its checks still decide detection.
        result.update(status="error", reason=raised)


def _attempt(step, result: dict):
    """Run one step of the parallel model; a raise becomes a failed check, and marks this world suspect."""
    try:
        return step(), None
    except Exception as exc:
        result.update(traceback=traceback.format_exc(), phase="parallel", raised=True)
        return None, f"{type(exc).__name__}: {exc}"


def _init_process_group(backend):
    """Join the world; returns the rendezvous store, which outlives any broken collective."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store_path = os.environ.get("PARACHECK_STORE")
    # Hangs are the launcher's to end (it captures stacks first); keep the library's own timeout long.
    timeout = timedelta(seconds=float(os.environ.get("PARACHECK_PG_TIMEOUT", 3600)))
    if store_path:
        store = dist.FileStore(store_path, world)
        dist.init_process_group(backend.dist_backend, store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend.dist_backend, timeout=timeout)
        store = dist.distributed_c10d._get_default_store()
    if backend.device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    return store


def _world_intact(store, index: int, world: int, timeout: float) -> bool:
    """After a case that raised mid-collectives: did every rank get to its end? Then none is stuck in a
    collective, and the next case can run in this world. The store is not a collective, so asking cannot hang."""
    try:
        store.wait([f"paracheck/done/{index}/{r}" for r in range(world)], timedelta(seconds=timeout))
        return True
    except Exception:
        return False


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rundir = argv[0]
    with open(os.path.join(rundir, "run.json")) as handle:
        run = json.load(handle)
    backend = get_backend(run["backend"])
    rank = int(os.environ["RANK"])
    stacks = open(os.path.join(rundir, f"stacks.{rank}.txt"), "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    if backend.device_type == "cpu":
        # Ranks share the machine's cores; more threads per rank only oversubscribe them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
    store = _init_process_group(backend)
    world = int(os.environ["WORLD_SIZE"])
    cases = [Case.from_json(c) for c in run["cases"]]
    todo = json.load(open(os.path.join(rundir, os.environ.get("PARACHECK_TODO", "todo.json"))))
    for index in todo:
        write_json(os.path.join(rundir, f"progress.{rank}.json"), {"index": index, "started": time.time()})
        workdir = os.path.join(rundir, f"case-{index}")
        os.makedirs(workdir, exist_ok=True)
        result = run_case(cases[index], backend, workdir)
        result["index"] = index
        write_json(os.path.join(rundir, "results", f"{index}.{rank}.json"), result)
        store.set(f"paracheck/done/{index}/{rank}", result["status"])
        if result.get("phase") == "parallel":
            if not _world_intact(store, index, world, float(run.get("timeout", 120))):
                return WORLD_BROKEN
    write_json(os.path.join(rundir, f"progress.{rank}.json"), {"index": None, "done": time.time()})
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())


def torchrun_main(argv=None) -> int:
    """`torchrun ... workers/spec_worker.py MODULE:FUNCTION --layout tp2xu2`: one case, one line per rank."""
    import argparse
    import tempfile

    from .layout import Layout

    parser = argparse.ArgumentParser(prog="spec_worker")
    parser.add_argument("spec")
    parser.add_argument("--layout", required=True)
    parser.add_argument("--route", default="auto")
    parser.add_argument("--order", default="cp-fastest")
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--no-grads", action="store_true")
    args = parser.parse_args(argv)
    backend = get_backend(args.backend)
    layout = Layout.parse(args.layout, args.order)
    if layout.world != int(os.environ["WORLD_SIZE"]):
        print(f"--layout {layout}: world size {layout.world} != WORLD_SIZE {os.environ['WORLD_SIZE']}", file=sys.stderr)
        return 2
    if backend.device_type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // layout.world))
    _init_process_group(backend)
    case = Case("spec", args.spec, layout, args.route, None, not args.no_grads)
    workdir = os.path.join(tempfile.gettempdir(), f"paracheck-torchrun-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}")
    os.makedirs(workdir, exist_ok=True)
    result = run_case(case, backend, workdir)
    failed = [c["id"] for c in result["checks"] if c["status"] == "fail"]
    forward_check = next((c for c in result["checks"] if c["id"] == "parity.forward"), {})
    status = "FAIL" if failed or result["status"] == "error" else result["status"].upper()
    print(f"[rank{result['rank']}] {status} {layout} route={result['route']} "
          f"max_abs={forward_check.get('max_abs')} failed={','.join(failed) or '-'} {result['reason']}".rstrip(),
          flush=True)
    dist.barrier()
    if result["rank"] == 0:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    dist.destroy_process_group()
    return 1 if status == "FAIL" else 0
