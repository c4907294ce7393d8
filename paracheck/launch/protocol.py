"""The run protocol between the launcher and its ranks: run-directory files, environment, exit codes.

How a run works. The launcher (torch-free) writes `run.json` (every case) into a private temp
directory and starts a *world*: one process per rank, forked from a prepared parent that already
imported torch and diffusers (or started fresh where forking is unsafe). The ranks meet through a
FileStore in that directory, so two runs on one machine never share a port or a file. Each rank runs
the cases listed in its world's todo file in order and, for every case, atomically writes one result
file and then sets a store key; before a case it writes its progress file, which is how the launcher
knows which case a stuck or dead rank was in. A rank that raised after collectives began waits a few
seconds for its peers to reach the end of the case; if they do not, it exits with `RankExit.BROKEN` and
the launcher replaces the world for the cases left. A *fed* world (`paracheck explore`) has no case list:
its todo file says where to start, and each rank waits for the launcher to write the next case file
(`feed/N.json`) until the launcher writes `stop`. Every file, store key and record of that exchange
(`RunDir`, the `store_*` keys, `Todo`, `RankProgress`, `WorldEnd`) is spelled here only; nothing in this
module imports torch.
"""

from __future__ import annotations

import enum
import json
import os
from dataclasses import dataclass, field


class Exit(enum.IntEnum):
    """`paracheck`'s exit codes (the contract)."""
    OK = 0          # every check passed; with --controls every control was detected
    FAILED = 1      # a check failed, a case raised, or a control went undetected
    USAGE = 2       # bad usage or input; the message names the argument and the rule
    BROKEN = 3      # the run itself broke: a rank died by signal, hung, could not start, or was interrupted


class RankExit(enum.IntEnum):
    """A rank process's exit codes, read by the launcher only."""
    DONE = 0
    BROKEN = 4      # a case raised mid-collectives and peers did not finish it: replace the world


# Environment a rank is started with, beside torch's RANK / WORLD_SIZE / LOCAL_RANK.
ENV_STORE = "PARACHECK_STORE"        # FileStore path of this world
#: The rank side's entry module (`main(rundir)`), named by path by both start methods: it sits above the launcher.
RANK_MODULE = "paracheck.rank.worker"
ENV_TODO = "PARACHECK_TODO"          # todo file name of this world (case indices, in order)
ENV_PG_TIMEOUT = "PARACHECK_PG_TIMEOUT"
ENV_PROFILE = "PARACHECK_PROFILE"    # a folder: each rank writes its cProfile stats there (rank-R.prof)

#: The switches a run's ranks read from the environment (`PARACHECK_LOCALIZE=0`, `PARACHECK_BARE=1`): the launcher
#: writes the ones it sees into run.json and every rank applies them before its cases, since a rank forks from a
#: fork server that may have started earlier, with an older environment (a pytest session, a benchmark's runs).
RUN_SWITCHES = ("PARACHECK_LOCALIZE", "PARACHECK_BARE")


def run_switches() -> dict:
    return {name: os.environ[name] for name in RUN_SWITCHES if name in os.environ}


def apply_switches(switches: dict) -> None:
    for name in RUN_SWITCHES:
        if name in switches:
            os.environ[name] = switches[name]
        else:
            os.environ.pop(name, None)


#: Seconds a rank that raised mid-case waits for its peers before it declares its world broken.
FAIL_FAST_GRACE = 5.0


#: Set by a rank that gives up on its world; a peer that then finishes the case must not go on in it.
STORE_BROKEN_KEY = "paracheck/broken"


def store_done_key(index: int, rank: int) -> str:
    return f"paracheck/done/{index}/{rank}"


def store_result_key(index: int, rank: int) -> str:
    """Under torchrun there is no run directory: a rank's result travels through the c10d store."""
    return f"paracheck/result/{index}/{rank}"


#: Under torchrun, rank 0 sets the run's exit code here for every rank to exit with.
STORE_EXIT_KEY = "paracheck/exit"


class Phase(str, enum.Enum):
    """Where a rank is, as its progress file says."""
    STARTED = "started"    # running case `index` since `at`
    WAITING = "waiting"    # a fed world: waiting for the next case file
    DONE = "done"          # its todo is finished


@dataclass(frozen=True)
class RankProgress:
    """One rank's progress file: written before each case and when it waits or is done."""
    phase: Phase
    at: float
    index: int | None = None

    def to_json(self) -> dict:
        return {"phase": self.phase.value, "at": self.at, "index": self.index}

    @classmethod
    def from_json(cls, data) -> "RankProgress | None":
        """None for anything that is not a progress record (a file from another version, a torn read)."""
        try:
            return cls(Phase(data["phase"]), float(data["at"]), data.get("index"))
        except (TypeError, KeyError, ValueError):
            return None

    @property
    def running(self) -> bool:
        return self.phase is Phase.STARTED and self.index is not None


@dataclass(frozen=True)
class Todo:
    """A world's todo file: the case indices to run in order, or (a fed world) the first case file to wait for."""
    indices: tuple[int, ...] = ()
    feed_from: int | None = None

    def to_json(self) -> dict:
        return {"indices": list(self.indices), "feed_from": self.feed_from}

    @classmethod
    def from_json(cls, data: dict) -> "Todo":
        return cls(tuple(data["indices"]), data["feed_from"])


class RunDir:
    """File names inside one run directory; the only place they are spelled."""

    def __init__(self, path: str):
        self.path = path

    def _at(self, *parts: str) -> str:
        return os.path.join(self.path, *parts)

    @property
    def run(self) -> str:
        return self._at("run.json")

    @property
    def results_dir(self) -> str:
        return self._at("results")

    @property
    def refs_dir(self) -> str:
        return self._at("refs")

    def todo(self, attempt: int) -> str:
        return self._at(f"todo.{attempt}.json")

    def store(self, attempt: int) -> str:
        return self._at(f"store.{attempt}")

    def log(self, attempt: int, rank: int) -> str:
        return self._at(f"log.{attempt}.{rank}.txt")

    def progress(self, rank: int) -> str:
        return self._at(f"progress.{rank}.json")

    def stacks(self, rank: int) -> str:
        return self._at(f"stacks.{rank}.txt")

    def result(self, index: int, rank: int) -> str:
        return self._at("results", f"{index}.{rank}.json")

    def feed(self, index: int) -> str:
        return self._at("feed", f"{index}.json")

    @property
    def stop(self) -> str:
        return self._at("stop")

    def case_dir(self, index: int) -> str:
        return self._at(f"case-{index}")

    def make(self) -> "RunDir":
        for folder in (self.results_dir, self.refs_dir, self._at("feed")):
            os.makedirs(folder, exist_ok=True)
        return self


def reference_file(refs_dir: str, key: str) -> str:
    """A reference's tensors, in a run directory's `refs` (or torchrun's own folder, which has no RunDir)."""
    return os.path.join(refs_dir, f"{key}.safetensors")


def reference_error_file(refs_dir: str, key: str) -> str:
    """Written instead of the tensors when the model failed on one device."""
    return os.path.join(refs_dir, f"{key}.error.json")


def write_json(path: str, data) -> None:
    """Write whole or not at all: a rank killed mid-write leaves no half file behind."""
    write_text(path, json.dumps(data, default=str))


def write_text(path: str, text: str) -> None:
    """Write `text` whole or not at all (a temp file beside `path`, flushed to disk, then renamed)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_json(path: str):
    """The file's data, or None when it is absent or (still) unreadable."""
    try:
        with open(path) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


class EndKind(str, enum.Enum):
    DONE = "done"              # every rank exited 0
    RANK_EXIT = "rank-exit"    # a rank exited non-zero or died by signal
    HANG = "hang"              # a case ran past the timeout
    START = "start"            # no rank started a case in time


@dataclass
class WorldEnd:
    """How one world ended, as the supervisor saw it and attribution reads it: per-rank exit codes (None: still running when stopped; < 0: signal)."""
    kind: EndKind
    attempt: int
    codes: list[int | None]
    stacks: dict[int, str] = field(default_factory=dict)
    progress: dict[int, RankProgress] = field(default_factory=dict)
    logs: dict[int, str] = field(default_factory=dict)
