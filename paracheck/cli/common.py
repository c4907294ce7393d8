"""What every command shares: `UsageError`, the options `run`, `explore` and `topology` all take, their
validation (each rule once), the models `--models` / `--spec` name, report writes and the run's metadata.

A leaf of the command line: it imports no command module and no torch.
"""

from __future__ import annotations

import os
import signal

from paracheck.domain.case import DTYPES
from paracheck.domain.layout import ORDERS


class UsageError(Exception):
    """Bad input: exit 2 with a message naming the argument and the rule."""


# -- shared options ---------------------------------------------------------------------------------


def add_order(parser) -> None:
    parser.add_argument("--order", default="cp-fastest", help="cp-fastest|tp-fastest (mesh order)")


#: Seconds a case may run by default, for one rank's work in a process.
TIMEOUT = 120.0
#: The world whose work one process does in TIMEOUT; a local world of more ranks gets TIMEOUT x ranks / this.
TIMEOUT_RANKS = 4


def add_timeout(parser) -> None:
    parser.add_argument("--timeout", type=float, default=None, help=f"seconds one case may run before it is a hang "
                        f"(default {TIMEOUT:g}; with --local-world N above {TIMEOUT_RANKS}, {TIMEOUT:g} x N / "
                        f"{TIMEOUT_RANKS}: one process does every rank's work)")


def add_after_hang(parser) -> None:
    parser.add_argument("--after-hang", default="skip", choices=("skip", "run"),
                        help="after a case hangs, the cases left on its model and layout: skip (reported "
                        "not run, with the reason; the default: a hang costs one timeout) or run")


def check_choice(flag: str, value: str, allowed) -> None:
    if value not in allowed:
        raise UsageError(f"{flag} {value!r}: must be one of {', '.join(allowed)}")


def check_order(order: str) -> None:
    check_choice("--order", order, ORDERS)


def check_timeout(seconds: float | None, local_world: int | None = None) -> float:
    """The case timeout: `--timeout` as given (> 0), else the default, scaled by a local world's ranks."""
    if seconds is None:
        return TIMEOUT * max(1.0, (local_world or 1) / TIMEOUT_RANKS)
    if seconds <= 0:
        raise UsageError(f"--timeout {seconds:g}: must be > 0 seconds")
    return seconds


def check_dtypes(text: str, several: bool = False) -> list[str]:
    """The dtypes `--dtype` names: one, or with `several` a comma list (explore draws from it)."""
    if not several:
        check_choice("--dtype", text, DTYPES)
        return [text]
    dtypes = [d.strip() for d in text.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES] or ([] if dtypes else ["(empty)"])
    if bad:
        raise UsageError(f"--dtype {text!r}: {', '.join(bad)}: dtypes are {', '.join(DTYPES)}")
    return dtypes


def check_writable(path: str | None, flag: str) -> None:
    """A report path's folder exists and can be written, checked before anything runs."""
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UsageError(f"{flag} {path}: not writable")


# -- models ------------------------------------------------------------------------------------------


def named_models(args) -> list[tuple[str, str]]:
    """(name, factory) for each model `--models` or `--spec` asks for (run and explore)."""
    from paracheck.domain.registry import select

    if args.spec and args.models != "all":
        raise UsageError("--models with --spec: --models names bundled fixtures; give one or the other")
    if args.spec:
        return spec_names(args.spec)
    try:
        return select(args.models)
    except ValueError as e:
        raise UsageError(f"--models {e}") from None


def spec_names(specs: list[str]) -> list[tuple[str, str]]:
    """A spec's model name is its function's name, or module:function where two functions share one."""
    short = [spec.rpartition(":")[2] for spec in specs]
    return [(name if short.count(name) == 1 else os.path.basename(spec), spec) for name, spec in zip(short, specs)]


# -- output ------------------------------------------------------------------------------------------


class Interrupted(KeyboardInterrupt):
    """A signal other than Ctrl-C, raised as Ctrl-C's KeyboardInterrupt: every `except KeyboardInterrupt` stops
    the run alike, and the report can say which signal it was."""


def raise_interrupt(signum, frame):
    """A SIGTERM handler: stop the way Ctrl-C does, so every rank is stopped on the way out."""
    raise Interrupted(signal.Signals(signum).name)


def signal_of(stop: KeyboardInterrupt) -> str:
    """The signal that stopped a run: SIGINT for Ctrl-C's own KeyboardInterrupt."""
    return stop.args[0] if isinstance(stop, Interrupted) and stop.args else "SIGINT"
