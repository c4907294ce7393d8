"""Ranks of a plain function, forked from the kit's preloaded fork server: for harnesses and benchmarks that
run their own code on every rank (op-level worlds, counting scripts), not cases.

`paracheck run` starts its ranks from a fork server that imported torch and the libraries once
(`rank.preload`); a harness that spawns fresh interpreters pays those imports once per rank instead (about
6 s each on a 2-core machine). A process holds one fork server, so a harness run from the kit's own tests
shares the one the in-process runs started.
"""

from __future__ import annotations

import multiprocessing
import time

from paracheck.launch import reaper


def fork_ranks(fn, args: tuple, world: int, timeout: float = 600.0) -> None:
    """Run `fn(rank, *args)` on `world` forked ranks and wait for all; a rank's raise is raised here with its
    traceback (torch's `ProcessRaisedException`), and ranks still running after `timeout` seconds are killed
    and TimeoutError raised (a deadlocked harness must not hang its caller). A forked rank inherits the fork
    server's environment, not this process's: `fn` sets what it needs."""
    import torch.multiprocessing as mp

    multiprocessing.get_context("forkserver").set_forkserver_preload(["paracheck.rank.preload"])
    context = mp.start_processes(fn, args=args, nprocs=world, join=False, start_method="forkserver")
    for process in context.processes:
        reaper.record(process.pid)
    reaper.record_servers()
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"fork_ranks: {fn.__name__} still running on some of {world} ranks after {timeout:.0f}s")
