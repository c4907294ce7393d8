"""A rank's first frame, importable without torch so the launcher can name it as a process target."""

from __future__ import annotations

import os
import sys

from paracheck.launch.protocol import RANK_MODULE


def rank_entry(rundir_path: str, env: dict, log_path: str) -> None:
    """Own session (so one kill reaches all the rank starts), own log on fds 1 and 2, own environment."""
    os.setsid()
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.update(env)
    import importlib

    # Named by path, as the fresh start names it on its command line: the rank side sits above the launcher.
    sys.exit(importlib.import_module(RANK_MODULE).main(rundir_path))
