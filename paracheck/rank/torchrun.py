"""`paracheck run` as one rank of a world torchrun made (RANK and WORLD_SIZE set), across nodes too.

Every rank runs the same cases with the same `worker.plan_and_run` as launcher-started ranks, and hands
each `RankResult` to rank 0 through torchrun's c10d store; rank 0 prints progress, the table and the
reports, then publishes the exit code, which every rank returns. References are computed by each rank
for itself (nodes share no run directory). A case past `--timeout` dumps this rank's stack and exits
with `Exit.BROKEN`; torchrun then stops the other ranks.
"""

from __future__ import annotations

import faulthandler
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from datetime import timedelta

from paracheck.launch.protocol import STORE_EXIT_KEY, Exit, store_result_key
from paracheck.domain.records import RankResult


class _Watchdog:
    """Ends this rank when one case runs past the timeout: torchrun has no supervisor that would."""

    def __init__(self, timeout: float):
        self.timeout, self.case, self.started = timeout, None, time.time()
        threading.Thread(target=self._watch, daemon=True).start()

    def begin(self, label: str) -> None:
        self.case, self.started = label, time.time()

    def _watch(self) -> None:
        while True:
            time.sleep(0.5)
            if self.case is not None and time.time() - self.started > self.timeout:
                print(f"paracheck: rank {os.environ.get('RANK')}: case {self.case} hung past --timeout "
                      f"{self.timeout:g}s; stack follows", file=sys.stderr, flush=True)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                os._exit(Exit.BROKEN)


def run_as_rank(args, backend, cases, entries) -> int:
    import torch.distributed as dist

    from paracheck.rank import declared
    from paracheck.rank.worker import case_ended, join, plan_and_run
    from paracheck.results.known import as_data

    store = join(backend)
    declared.use(as_data(entries))
    rank, world = dist.get_rank(), dist.get_world_size()
    workdir = tempfile.mkdtemp(prefix=f"paracheck-torchrun-{rank}-")
    refs_dir = os.path.join(workdir, "refs")
    os.makedirs(refs_dir)
    watchdog = _Watchdog(args.timeout)
    results, started = [], time.time()
    progress = _progress(args, cases, entries) if rank == 0 else None
    for index, case in enumerate(cases):
        watchdog.begin(case.id)
        # Nodes share no run directory, so every rank computes the references it needs itself.
        result = plan_and_run(index, case, backend, lambda key: True, refs_dir,
                              os.path.join(workdir, f"case-{index}"))
        _say(_rank_line(result, case))
        store.set(store_result_key(index, rank), json.dumps(result.to_json()))
        if not case_ended(store, result, world):
            print(f"paracheck: rank {rank}: case {case.id} raised and its peers did not finish it; stopping "
                  f"this world ({result.reason})", file=sys.stderr, flush=True)
            shutil.rmtree(workdir, ignore_errors=True)
            os._exit(Exit.BROKEN)
        if rank == 0:
            ranks = [RankResult.from_json(json.loads(store.get(store_result_key(index, r)))) for r in range(world)]
            results.append(ranks)
            progress.case_done(index, ranks)
    watchdog.case = None
    shutil.rmtree(workdir, ignore_errors=True)
    return _finish(args, backend, cases, progress.judged(results) if rank == 0 else [], store, rank, started)


def _finish(args, backend, cases, verdicts, store, rank: int, started: float) -> int:
    import torch.distributed as dist

    if rank == 0:
        from dataclasses import replace

        from paracheck.results.report import run_meta
        from paracheck.results.finish import finish

        meta = replace(run_meta(backend, dist.get_world_size()), worlds=1, start_method="torchrun")
        code = finish(args, verdicts, [], meta, time.time() - started, ", ranks torchrun")
        store.set(STORE_EXIT_KEY, str(int(code)))
    else:
        store.wait(["paracheck/exit"], timedelta(seconds=args.timeout * max(len(cases), 1)))
        code = int(store.get(STORE_EXIT_KEY))
    dist.barrier()
    dist.destroy_process_group()
    return code


def _say(line: str) -> None:
    """One write of the whole line: every rank shares torchrun's stdout, and a line written in pieces can
    be split by another rank's (measured: a rank's line missing from the log under load)."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (line + "\n").encode())


def _progress(args, cases, entries):
    from paracheck.results.progress import Progress

    return Progress(cases, quiet=args.quiet, entries=entries)


def _rank_line(result: RankResult, case) -> str:
    """One line per case on every rank, so each node's log says what its ranks saw."""
    from paracheck.domain.records import CheckId, Status

    failed = [c.id.value for c in result.checks if c.status == Status.FAIL]
    fwd = result.check(CheckId.FORWARD)
    figure = f" max_abs={fwd.max_abs:.1e}" if fwd and fwd.max_abs is not None else ""
    status = "FAIL" if failed or result.status.value == "error" else result.status.value.upper()
    return (f"[rank{result.rank}] {status} {case.id_with(result.route)}{figure} failed={','.join(failed) or '-'}"
            + (f" {result.reason}" if result.reason else ""))
