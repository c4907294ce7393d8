"""The rank side: join a world, run many cases in it, and leave one `RankResult` per case.

Entered through `launch.rankstart` (forked from the launcher's prepared parent, or spawned fresh), through
`paracheck run` under torchrun (`paracheck.rank.torchrun`), or through `workers/spec_worker.py`. All three
share `join` (the rank setup) and `plan_and_run`, which runs each case through the one skeleton
(`rank.skeleton`) and its library's adapter: this loop knows no library. See `launch.protocol` for how ranks and launcher talk.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import resource
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from paracheck.domain.registry import parse_layout
from paracheck.rank import declared
from paracheck.rank.skeleton import run_case
from paracheck.domain.backends import get_backend
from paracheck.domain.case import Case
from paracheck.domain.records import RankResult
from paracheck.launch.protocol import (ENV_PG_TIMEOUT, ENV_PROFILE, ENV_STORE, ENV_TODO, FAIL_FAST_GRACE,
                                       STORE_BROKEN_KEY, Phase, RankExit, RankProgress, RunDir, Todo, apply_switches,
                                       read_json, store_done_key, write_json)
from paracheck.world import meshes
from paracheck.world.site import CaseSite, Owners, local_device


def join(backend, store_path: str | None = None):
    """Set this process up as one rank and join the world; returns the rendezvous store."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if backend.name == "neuron":
        # torch-neuronx registers the "neuron" device and process-group backend when imported, and must
        # be imported before the process group exists (each rank is a fresh interpreter on Neuron).
        import torch_neuronx  # noqa: F401
    if backend.device_type == "cpu":
        # Ranks share the machine's cores; more threads per rank only oversubscribe them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    if backend.device_type == "cuda":
        torch.cuda.set_device(local_device(backend))
    # Hangs are the launcher's to end (it captures stacks first); keep the library's own timeout long.
    timeout = timedelta(seconds=float(os.environ.get(ENV_PG_TIMEOUT, 3600)))
    if store_path:
        store = dist.FileStore(store_path, world)
        dist.init_process_group(backend.dist_backend, store=store, rank=rank, world_size=world, timeout=timeout)
        return store
    dist.init_process_group(backend.dist_backend, timeout=timeout)
    return dist.distributed_c10d._get_default_store()


def measure(result: RankResult) -> None:
    """This rank's memory and CPU when the case is over (its model freed; the last reference is kept)."""
    _release_memory()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result.peak_rss_mb = round(usage.ru_maxrss / 1024, 1)
    result.rss_mb = _rss_mb()
    result.cpu_seconds = round(usage.ru_utime + usage.ru_stime, 3)
    result.threads, result.process_groups = _threads(), len(meshes.group_names())


def _threads() -> int:
    """This process's threads now: gloo keeps three per process group, so a leak of groups shows here."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()  # Python's threads only, where there is no /proc


#: Cases between two collections that also walk what earlier cases left alive (see `_release_memory`), and
#: the growth of resident memory since the last such collection that brings one forward.
THAW_EVERY = 64
THAW_GROWTH_MB = 256.0
_released, _rss_after_thaw = 0, 0.0


def _release_memory() -> None:
    """Free the case's model now, not whenever the collector next runs (its hooks make reference cycles),
    and hand the freed heap back to the system, so a rank's resident memory does not ratchet up over cases.

    What survives a case (modules the library imported lazily, caches, the kept reference) is frozen, so
    the next case's collection walks only that case's objects: 1.5 ms instead of 25 ms a case, measured.
    Every `THAW_EVERY` cases, or sooner once resident memory grew `THAW_GROWTH_MB` since the last time,
    everything is thawed for one full collection, so a kept object with a cycle (a user's reference model,
    say) that was dropped while frozen is still freed, late but bounded in cases and in memory."""
    global _released, _rss_after_thaw
    _released += 1
    thaw = _released % THAW_EVERY == 0 or _rss_mb() > _rss_after_thaw + THAW_GROWTH_MB
    if thaw:
        gc.unfreeze()
    gc.collect()
    gc.freeze()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    if thaw:
        _rss_after_thaw = _rss_mb()


def started_at(rss_mb: float) -> None:
    """The resident memory the rank starts its cases with, what `THAW_GROWTH_MB` is counted from. Counted from 0,
    the first case always thawed: a full collection of everything the fork server imported, whose walk also
    copies each page it touches out of the fork server's (1.1 to 1.3 s a rank, measured, in every world)."""
    global _rss_after_thaw
    _rss_after_thaw = rss_mb


def _libc():
    """glibc, whose `malloc_trim` returns freed heap pages; None elsewhere (musl, macOS)."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _libc()


def _rss_mb() -> float:
    """Resident memory now (the peak alone hides whether memory comes back after a big case)."""
    try:
        with open("/proc/self/statm") as handle:
            return round(int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
    except (OSError, ValueError, IndexError):
        return 0.0


# -- many cases in one world -----------------------------------------------------------------------


def run_world(rundir: RunDir, todo, backend, store) -> int:
    """Run the cases `todo` yields as (index, case), in order; each reference is computed by one rank and
    read by the others."""
    rank, world = dist.get_rank(), dist.get_world_size()
    owners = Owners(world)
    for index, case in todo:
        write_json(rundir.progress(rank), RankProgress(Phase.STARTED, time.time(), index).to_json())
        result = plan_and_run(index, case, backend, lambda key: owners.owner(key) == rank,
                              rundir.refs_dir, rundir.case_dir(index))
        write_json(rundir.result(index, rank), result.to_json())
        if not case_ended(store, result, world):
            return RankExit.BROKEN
    write_json(rundir.progress(rank), RankProgress(Phase.DONE, time.time()).to_json())
    return RankExit.DONE


def plan_and_run(index: int, case: Case, backend, computes, refs_dir: str, workdir: str) -> RankResult:
    """Run the case through the kit's skeleton and its library's adapter (which computes the reference where
    `computes(key)` says this rank does), then measure what the rank holds after it."""
    os.makedirs(workdir, exist_ok=True)
    result = run_case(case, backend, CaseSite(index, workdir, refs_dir, computes))
    measure(result)
    return result


def case_ended(store, result: RankResult, world: int) -> bool:
    """Tell the peers this rank ended the case; False when the world is broken and the rank must stop
    (it then says so in the store, so a peer that finishes the case does not go on either)."""
    store.set(store_done_key(result.index, result.rank), result.status.value)
    if result.raised_in_parallel and not world_intact(store, result.index, world,
                                                      max(FAIL_FAST_GRACE, result.seconds)):
        store.set(STORE_BROKEN_KEY, str(result.rank))
        return False
    return True


def world_intact(store, index: int, world: int, grace: float) -> bool:
    """After a case that raised mid-collectives: did every rank get to its end within `grace`? Then none
    is stuck in a collective and the next case can run here. The store is no collective: asking cannot hang."""
    try:
        store.wait([store_done_key(index, r) for r in range(world)], timedelta(seconds=grace))
    except Exception:
        return False
    # A peer finished only because another gave up (its collective broke when that one left).
    return not store.check([STORE_BROKEN_KEY])


def fed(rundir: RunDir, start: int, rank: int, poll: float = 0.02):
    """The cases of a fed world, as the launcher writes them, until it writes `stop`."""
    index = start
    while True:
        write_json(rundir.progress(rank), RankProgress(Phase.WAITING, time.time()).to_json())
        while (data := read_json(rundir.feed(index))) is None:
            if os.path.exists(rundir.stop):
                return
            time.sleep(poll)
        yield index, Case.from_json(data, parse_layout)
        index += 1


def thread_lock_for_progress_bars() -> None:
    """A library's tqdm bars (transformers' loading and saving) lock a multiprocessing RLock by default: a semaphore
    the resource tracker holds for this rank, which a rank killed with its broken world never releases, so the
    launcher's tracker warned of 3 leaked semaphores per broken world at exit. A rank's bars need a thread lock."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


def main(rundir_path: str) -> int:
    rundir = RunDir(rundir_path)
    run = read_json(rundir.run)
    apply_switches(run.get("switches", {}))
    declared.use(run.get("known", []))
    thread_lock_for_progress_bars()
    backend = get_backend(run["backend"])
    if run.get("local_world"):
        return _local(rundir, run, backend)
    rank = int(os.environ["RANK"])
    stacks = open(rundir.stacks(rank), "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    store = join(backend, os.environ[ENV_STORE])
    # Everything imported so far lives as long as the rank: the collector need not walk it again after each case.
    gc.freeze()
    started_at(_rss_mb())
    todo = Todo.from_json(read_json(os.path.join(rundir.path, os.environ[ENV_TODO])))
    if todo.feed_from is not None:
        feed = fed(rundir, todo.feed_from, rank)
    else:
        cases = [Case.from_json(c, parse_layout) for c in run["cases"]]
        feed = ((i, cases[i]) for i in todo.indices)
    code = _profiled(lambda: run_world(rundir, feed, backend, store), rank)
    if code == RankExit.DONE:
        # No rank tears gloo down while a peer is still in a collective. (A case that raised inside the
        # library's ring attention, after it issued its KV all-gather, leaves that gather never waited.)
        dist.barrier()
        dist.destroy_process_group()
    return int(code)


def _local(rundir: RunDir, run: dict, backend) -> int:
    """This process is every rank of a local world (`rank.localrun`): the launcher started it alone."""
    from paracheck.rank.localrun import run_local_world

    stacks = open(rundir.stacks(0), "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    gc.freeze()
    started_at(_rss_mb())
    todo = Todo.from_json(read_json(os.path.join(rundir.path, os.environ[ENV_TODO])))
    cases = [Case.from_json(c, parse_layout) for c in run["cases"]]
    return int(_profiled(lambda: run_local_world(rundir, ((i, cases[i]) for i in todo.indices), backend,
                                                 int(run["local_world"]), measure), 0))


def _profiled(run, rank: int):
    """`run()`, under cProfile when PARACHECK_PROFILE names a folder (one `rank-R.prof` per rank there):
    a developer's view of where a rank's time goes, with no profiler to install. It counts CPU time, not
    wall time: four ranks on a shared machine mostly wait for a core, and that is not the code's cost."""
    folder = os.environ.get(ENV_PROFILE)
    if not folder:
        return run()
    import cProfile

    profiler = cProfile.Profile(time.process_time)
    try:
        return profiler.runcall(run)
    finally:
        os.makedirs(folder, exist_ok=True)
        profiler.dump_stats(os.path.join(folder, f"rank-{rank}.prof"))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
