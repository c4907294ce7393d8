"""Ranks of a plain function, forked from the kit's preloaded fork server: for harnesses and benchmarks that
run their own code on every rank (op-level worlds, counting scripts), not cases.

`paracheck run` starts its ranks from a fork server that imported torch and the libraries once
(`rank.preload`); a harness that spawns fresh interpreters pays those imports once per rank instead (about
6 s each on a 2-core machine). A process holds one fork server, so a harness run from the kit's own tests
shares the one the in-process runs started.
"""

from __future__ import annotations

import multiprocessing


def fork_ranks(fn, args: tuple, world: int) -> None:
    """Run `fn(rank, *args)` on `world` forked ranks and wait for all; a rank's raise is raised here with its
    traceback (torch's `ProcessRaisedException`). A forked rank inherits the fork server's environment, not
    this process's: `fn` sets what it needs."""
    import torch.multiprocessing as mp

    multiprocessing.get_context("forkserver").set_forkserver_preload(["paracheck.rank.preload"])
    mp.start_processes(fn, args=args, nprocs=world, join=True, start_method="forkserver")
