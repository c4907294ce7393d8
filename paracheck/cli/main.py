"""The command line: `paracheck run`, `paracheck explore`, `paracheck topology`. Exit codes are `protocol.Exit`.

Parsing, usage errors and `topology` import no torch; `run` imports it only to load `--spec` factories.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from dataclasses import replace

from paracheck import __version__
from paracheck.domain.backends import BackendError, get_backend, missing_devices, resolve
from paracheck.domain import registry
from paracheck.domain.adapter import CaseRequest, TopologyRequest
from paracheck.domain.case import ROUTES, Case, SpecError
from paracheck.cli.common import (UsageError, add_after_hang, add_order, add_timeout, check_choice, check_dtypes, check_order,
                                  check_timeout, check_writable, named_models, raise_interrupt, signal_of)
from paracheck.results.report import run_meta
from paracheck.domain.layout import LayoutError
from paracheck.launch.protocol import Exit
from paracheck.cli.tiers import add_all, add_training, choose as choose_tier


def parser() -> argparse.ArgumentParser:
    """The command line of every command (public for tests that build cases in process)."""
    parser = argparse.ArgumentParser(prog="paracheck", description="Parallel correctness checks: every rank of a parallel model against one device.")
    parser.add_argument("--version", action="version", version=f"paracheck {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run models over layouts and check every rank against one device")
    run.add_argument("--backend", default="auto", help="auto|gloo|nccl|neuron (auto: nccl with CUDA devices, neuron with "
                     "Neuron devices, else gloo)")
    run.add_argument("--nproc", type=int, default=None, help="ranks in the world (default 4; under torchrun "
                     "its WORLD_SIZE)")
    run.add_argument("--local-world", type=int, default=None, metavar="N",
                     help="run every rank of an N-rank world in this one process (torch's LocalTensorMode): the same "
                     "checks and report, layouts of N ranks (docs/local-world.md)")
    run.add_argument("--models", default="all", help="fixture names, comma separated; all (every installed adapter's "
                     "fixtures) or an adapter's name (its fixtures); see docs/cli.md")
    run.add_argument("--layouts", default="all", help="layout names in each model's grammar (docs/layouts.md), "
                     "or all for --nproc")
    run.add_argument("--route", default="auto", help="auto|native|composed|sharded-load|neuron-tp")
    add_order(run)
    run.add_argument("--spec", action="append", help="MODULE:NAME: your own model, in its adapter's spec convention "
                     "(docs/cli.md); repeat for several")
    run.add_argument("--no-grads", action="store_true", help="skip parity.grads")
    run.add_argument("--controls", action="store_true", help="also run every negative control")
    run.add_argument("--only-control", help="with --controls: run this control alone (and no plain cases)")
    run.add_argument("--dtype", default="fp32", help="fp32|bf16|fp16: the dtype the models run in")
    run.add_argument("--attention-backend", default="auto", help="auto (the library's own backend wherever one can run the "
                     "layout on the device; see docs/cli.md) or a backend name of the model's library")
    run.add_argument("--variants", default=None, help="input variants: all, or names (each model runs the ones it "
                     "offers; docs/variants.md); unset: each adapter's default")
    run.add_argument("--cp-options", default="", help="the library's context-parallel options for every CP "
                     "layout, name=value comma separated (docs/cli.md)")
    run.add_argument("--known-failures", default=None, help="TOML of declared upstream failures, or none "
                     "(default: the file paracheck ships)")
    run.add_argument("--report-json", help="write the JSON report here")
    run.add_argument("--junit", help="write JUnit XML here")
    run.add_argument("--html", help="write the HTML report here (one self-contained file, opens offline)")
    run.add_argument("--shard", help="I/N: run the I-th of N deterministic slices of the cases (a model's cases "
                     "stay in one slice)")
    run.add_argument("--resume", help="REPORT.json: leave out the cases this earlier JSON report holds (all but "
                     "errors and those an interrupted run did not finish); its cases are carried into this run's report")
    add_timeout(run)
    add_after_hang(run)
    add_all(run)
    add_training(run)
    run.add_argument("--quiet", action="store_true", help="no per-case lines: only the table and the summary")
    from paracheck.cli.explore import add_parser

    add_parser(sub)
    from paracheck.cli.report import add_parser as add_report

    add_report(sub)
    topo = sub.add_parser("topology", help="which layouts a backend can run for a world size and head count")
    topo.add_argument("--backend", required=True, help="gloo|nccl|neuron: whose topology rules apply "
                      "(with --simulate, a comma list judges one simulation by each)")
    topo.add_argument("--world", type=int, required=True, help="ranks in the world")
    topo.add_argument("--heads", type=int, help="the model's attention head count (required without --simulate; "
                      "with it, overrides the model config's num_attention_heads)")
    topo.add_argument("--layout", help="one layout to judge (exit 1 when refused); default: every layout")
    add_order(topo)
    if _simulators():
        add_simulate(topo)
    return parser


#: The options that only mean something with `topology --simulate` (dest -> flag): the contract's, the host's to
#: parse and refuse; an adapter is handed them as a `TopologyRequest`.
SIMULATE_ONLY = {"models": "--models", "spec": "--spec", "route": "--route", "control": "--control",
                 "collectives": "--collectives", "report_json": "--report-json"}


def add_simulate(topo) -> None:
    """`topology --simulate` and its options, where an adapter simulates a world."""
    topo.add_argument("--simulate", action="store_true",
                      help="build each rank's model on meta under torch's fake process group and check what "
                           "the library really built (no hardware; up to 128 ranks)")
    topo.add_argument("--models", help="with --simulate: fixture names, comma separated, or all (default all)")
    topo.add_argument("--spec", action="append", help="with --simulate: MODULE:FUNCTION returning (model_class, "
                      "init_dict, inputs) (docs/topology.md names full-size ones)")
    topo.add_argument("--route", help="with --simulate: auto|native|composed (default auto)")
    topo.add_argument("--control", help="with --simulate: plant this negative control on every rank")
    topo.add_argument("--collectives", action="store_true",
                      help="with --simulate: run one forward on meta tensors and check its collectives per group")
    topo.add_argument("--report-json", help="with --simulate: write the results here")


def topology_request(args) -> TopologyRequest:
    """What `topology --simulate` asks an adapter, read off the parsed options once."""
    return TopologyRequest(args.backend, args.world, args.heads, args.layout, args.order, args.models,
                           tuple(args.spec or ()), args.route, args.control, args.collectives, args.report_json)


def _simulators() -> list:
    """The adapters that simulate a world (`topology --simulate`): those with a `topology_simulate`."""
    return [a for a in registry.adapters().values() if a.provides("topology_simulate")]


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    from paracheck.results.known import KnownFailuresError

    try:
        if args.command == "topology":
            return topology(args)
        if args.command == "report":
            from paracheck.cli.report import report

            return report(args)
        if args.command == "explore":
            from paracheck.cli.explore import explore

            return explore(args)
        return run(args)
    except (UsageError, LayoutError, BackendError, SpecError, KnownFailuresError) as exc:
        print(f"paracheck: error: {exc}", file=sys.stderr)
        return Exit.USAGE


def _check_local_world(args, backend) -> None:
    """`--local-world N`: the world's size is N (so `--nproc`, if given, must say N), on the CPU, not under torchrun."""
    n = getattr(args, "local_world", None)
    if n is None:
        return
    if n < 1:
        raise UsageError(f"--local-world {n}: must be >= 1")
    if args.nproc not in (None, n):
        raise UsageError(f"--local-world {n} --nproc {args.nproc}: a local world's ranks are its N; drop --nproc")
    if backend.device_type != "cpu":
        raise UsageError(f"--local-world {n} --backend {backend.name}: a local world runs on the CPU, under torch's "
                         "fake process group (use --backend gloo or auto)")
    if "RANK" in os.environ:
        raise UsageError(f"--local-world {n}: under torchrun this process is one rank of torchrun's world; run it "
                         "without torchrun")
    args.nproc = n


def _check_options(args, backend) -> None:
    _check_local_world(args, backend)
    world = os.environ.get("WORLD_SIZE") if "RANK" in os.environ else None
    if world is not None and args.nproc not in (None, int(world)):
        raise UsageError(f"--nproc {args.nproc}: under torchrun the world is WORLD_SIZE={world}; drop --nproc")
    args.nproc = int(world) if world is not None else (4 if args.nproc is None else args.nproc)
    if args.nproc < 1:
        raise UsageError(f"--nproc {args.nproc}: must be >= 1")
    missing = missing_devices(backend, int(os.environ.get("LOCAL_WORLD_SIZE", args.nproc)))
    if missing:
        raise UsageError(missing)
    check_order(args.order)
    check_choice("--route", args.route, ROUTES)
    check_dtypes(args.dtype)
    args.timeout = check_timeout(args.timeout, getattr(args, "local_world", None))
    every_control = registry.controls()
    if args.only_control and args.only_control not in every_control:
        raise UsageError(f"--only-control {args.only_control!r}: must be one of {', '.join(every_control)}")
    if args.only_control and not args.controls:
        raise UsageError("--only-control needs --controls")


def build_cases(args, backend) -> list[Case]:
    """Every case the run asks for: the models by adapter, each adapter expanding its own (errors exit 2)."""
    models = named_models(args)
    _check_options(args, backend)
    variants = _wanted_variants(args.variants)
    by_library: dict[str, list] = {}
    for model, factory in models:
        by_library.setdefault(registry.library_of(factory), []).append((model, factory))
    named = bool(args.spec) or args.models != "all"
    cases = []
    for library, chosen in by_library.items():
        adapter = registry.adapter(library)
        layouts = _layouts_of(library, args.layouts, args.order, by_library)
        request = CaseRequest(chosen, layouts, args.nproc, args.order, variants, args.controls,
                              args.only_control, not args.no_grads, args.dtype, args.route, args.cp_options,
                              args.attention_backend, spec=bool(args.spec), named=named,
                              everything=getattr(args, "all", False))
        if args.dtype not in adapter.dtypes and named and _only_library(args, library, by_library):
            raise UsageError(f"--dtype {args.dtype}: the {library} adapter runs {', '.join(adapter.dtypes)} only")
        try:
            cases += adapter.expand(request)
        except SpecError:
            raise
        except ValueError as exc:  # the adapter's rules, each naming the argument
            raise UsageError(str(exc)) from exc
    return choose_tier(args, cases)


def _layouts_of(library: str, text: str, order: str, by_library: dict) -> str:
    """`--layouts` for `library` in a run of several libraries: the names its grammar reads (each library has its
    own: `dpr4` is transformers', `u4` diffusers'). A name no library reads, or a library left with none, is a
    usage error naming each grammar's rule."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if len(by_library) == 1 or text.strip() == "all":
        return text
    why = {lib: {n: _unread(lib, n, order) for n in names} for lib in by_library}
    unread = [n for n in names if all(why[lib][n] for lib in by_library)]
    if unread:
        rules = "; ".join(f"{lib}: {why[lib][unread[0]]}" for lib in by_library)
        raise UsageError(f"--layouts {text!r}: {unread[0]!r} is no layout of any library in this run ({rules})")
    mine = [n for n in names if not why[library][n]]
    if not mine:
        raise UsageError(f"--layouts {text!r}: none is a {library} layout, for {', '.join(m for m, _ in by_library[library])} "
                         f"({why[library][names[0]]})")
    return ",".join(mine)


def _unread(library: str, name: str, order: str) -> str:
    """Why `library`'s grammar does not read `name` ("" where it does)."""
    try:
        registry.parse_layout(library, name, order)
    except (LayoutError, ValueError) as exc:
        return str(exc)
    return ""


def _only_library(args, library: str, by_library: dict) -> bool:
    """The run asked for this library's models alone (a refusal then leaves nothing to run)."""
    return len(by_library) == 1 or args.models == library


def _wanted_variants(text: str | None) -> list[str] | None:
    """--variants as names every adapter's variants include, or None where unset (each adapter's default)."""
    every = list(dict.fromkeys(v for a in registry.adapters().values() for v in a.variants()))
    if text is None:
        return None
    if text.strip() == "all":
        return every
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in names if v not in every]
    if unknown or not names:
        raise UsageError(f"--variants {text!r}: {', '.join(unknown) or 'empty'}: variants are {', '.join(every)} "
                         "(or all)")
    return names


def check_libraries(cases: list[Case]) -> None:
    """Exit 2, in one line, on a library installed at a version its adapter cannot serve (before any rank starts)."""
    for library in dict.fromkeys(c.library for c in cases):
        problem = registry.adapter(library).unsupported()
        if problem:
            raise UsageError(problem)


def run(args) -> int:
    from paracheck.results import known

    backend = resolve(args.backend)
    entries = known.load(known.SHIPPED if args.known_failures is None else args.known_failures)
    sweeper = _sweeper(args.models)
    if sweeper is not None:  # LIBRARY:NAMES: an adapter's sweep over the library's own families
        return _swept(args, backend, entries, sweeper)
    cases = _sharded(args, build_cases(args, backend))
    check_libraries(cases)
    cases, carried = _resumed(args, cases)
    check_writable(args.report_json, "--report-json")
    check_writable(args.junit, "--junit")
    check_writable(args.html, "--html")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        from paracheck.rank.torchrun import run_as_rank

        return run_as_rank(args, backend, cases, entries)
    return _launch(args, backend, cases, entries, carried)


def _swept(args, backend, entries, adapter) -> int:
    """`--models LIBRARY:NAMES`: the adapter plans and builds its families (`Adapter.sweep`); the run launches
    as every other run does, the cases the sweep decided before launch judged with the rest."""
    from paracheck.domain.adapter import SweepRequest

    _check_options(args, backend)
    request = SweepRequest(args.models.partition(":")[2], args.layouts, args.nproc, args.controls, args.only_control,
                           args.all, args.shard, args.resume, steps=getattr(args, "steps", 0),
                           checkpoint=not getattr(args, "no_checkpoint", True))
    for path, option in ((args.report_json, "--report-json"), (args.junit, "--junit"), (args.html, "--html")):
        check_writable(path, option)
    try:
        swept = adapter.sweep(request)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if args.resume:
        held, total = len(swept.carried), len(swept.carried) + len(swept.cases)
        print(f"paracheck: --resume {args.resume}: {held} of {total} cases held there, {len(swept.cases)} to run",
              file=sys.stderr)
    try:
        return _launch(args, backend, swept.cases, entries, swept.carried, swept)
    finally:
        swept.close()


def _resumed(args, cases: list[Case]) -> tuple[list[Case], list[dict]]:
    """`--resume REPORT.json`: the cases that report does not hold, and its entries for those it does."""
    from paracheck.results import resume

    if not args.resume:
        return cases, []
    try:
        todo, carried = resume.left(cases, resume.held(args.resume))
    except resume.ResumeError as exc:
        raise UsageError(str(exc)) from exc
    print(f"paracheck: --resume {args.resume}: {len(carried)} of {len(cases)} cases held there, {len(todo)} to run",
          file=sys.stderr)
    return todo, carried


def _sweeper(models: str):
    """The adapter whose sweep `--models LIBRARY:NAMES` asks for (`Adapter.sweep`); None for other --models."""
    library, sep, _ = models.partition(":")
    if not sep:
        return None
    try:
        adapter = registry.adapter(library)
    except ValueError as exc:
        raise UsageError(f"--models {models}: {exc}") from exc
    if not adapter.provides("sweep"):
        raise UsageError(f"--models {models}: the {library} adapter has no sweep of its library's families")
    return adapter


def _sharded(args, cases: list[Case]) -> list[Case]:
    from paracheck.domain.sharding import ShardError, parse_shard, shard

    if not args.shard:
        return cases
    try:
        return shard(cases, *parse_shard(args.shard), group=lambda case: case.model)
    except ShardError as exc:
        raise UsageError(str(exc)) from exc


def _launch(args, backend, cases: list[Case], entries, carried: list[dict], swept=None) -> int:
    """Every run's launch: the cases a sweep decided before launch (`swept.decided`) are judged with the rest,
    never handed to a rank."""
    from paracheck.launch.launcher import Launcher
    from paracheck.results import known
    from paracheck.results.finish import finish, interrupted
    from paracheck.results.progress import Progress
    from paracheck.results.verdict import judge

    decided = swept.decided if swept else {}
    # Judged before any launch: as finished whether the run ends or is stopped.
    verdicts = dict(zip(decided, judge([cases[i] for i in decided], list(decided.values()), entries)))
    launched = [i for i in range(len(cases)) if i not in decided]
    todo = [cases[i] for i in launched]
    progress = Progress(todo, quiet=args.quiet, entries=entries)
    launcher = Launcher(backend, args.nproc, args.timeout, on_case=progress.case_done, after_hang=args.after_hang,
                        known=known.as_data(entries), local_world=bool(getattr(args, "local_world", None)))
    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    started = time.time()
    try:
        outcome = launcher.run(todo) if todo else None
    except KeyboardInterrupt as stop:
        launcher.stop()
        progress.close()
        print("paracheck: interrupted; every rank was stopped", file=sys.stderr)
        verdicts.update((launched[k], v) for k, v in progress.verdicts.items())
        return interrupted(args, [verdicts[i] for i in sorted(verdicts)],
                           [c.id for i, c in enumerate(cases) if i not in verdicts], run_meta(backend, args.nproc),
                           time.time() - started, signal_of(stop), carried=carried)
    finally:
        signal.signal(signal.SIGTERM, previous)
    progress.close()
    meta = run_meta(backend, args.nproc, outcome).with_extra(**(swept.meta if swept else {}))
    verdicts.update(zip(launched, progress.judged([outcome.results[k] for k in range(len(todo))] if todo else [])))
    tail = f", ranks {outcome.start_method}, {outcome.references} references" if outcome else ""
    # Each event named by its case's verdict (the route resolved): an event's index counts the launched cases only.
    events = [replace(e, case=verdicts[launched[e.index]].id) if e.index is not None else e
              for e in (outcome.events if outcome else [])]
    return finish(args, [verdicts[i] for i in range(len(cases))], events, meta,
                  time.time() - started, tail + (swept.tail if swept else ""), carried)


def topology(args) -> int:
    simulators = _simulators()
    if getattr(args, "simulate", False):
        return simulators[0].topology_simulate(topology_request(args))
    for dest, flag in SIMULATE_ONLY.items():
        if getattr(args, dest, None) not in (None, False):
            raise UsageError(f"{flag}: only with --simulate")
    if args.heads is None:
        raise UsageError("--heads: required without --simulate (with --simulate the model's config gives it)")
    backend = get_backend(args.backend)
    if args.world < 1:
        raise UsageError(f"--world {args.world}: must be >= 1")
    if args.heads < 1:
        raise UsageError(f"--heads {args.heads}: must be >= 1")
    judges = [a for a in registry.adapters().values() if a.provides("topology_layouts")]
    if not judges:
        raise UsageError("topology: no adapter here judges layouts by head count")
    bad = 0
    for name, problems, groups in judges[0].topology_layouts(backend, args.world, args.heads, args.layout, args.order):
        print(f"{name:12} {'ok' if not problems else 'no':3} {'; '.join(problems) or groups}")
        bad += bool(problems)
    return Exit.FAILED if args.layout and bad else Exit.OK

if __name__ == "__main__":
    sys.exit(main())
