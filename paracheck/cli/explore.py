"""The `paracheck explore` command: its options, the models it may draw (with their layouts in their library's
grammar), its progress lines and report.

Usage errors import no torch; everything after them does (explore builds inputs in the launcher).
"""

from __future__ import annotations

import random
import signal
import sys
import time

from paracheck.domain import registry
from paracheck.domain.case import SpecError
from paracheck.cli.common import (UsageError, add_order, add_timeout, check_dtypes, check_order, check_timeout,
                                  check_writable, named_models, raise_interrupt)
from paracheck.results.report import run_meta
from paracheck.results.runmeta import RunMeta
from paracheck.results.report import write_report
from paracheck.launch.protocol import Exit

#: New cases explore generates by default (shrinking comes on top): enough to find both LTX bugs of
#: diffusers 0.42.1 on `--models ltx` from scratch (see docs/explore.md for the measured cost).
DEFAULT_EXAMPLES = 150


def add_parser(sub) -> None:
    p = sub.add_parser("explore", help="draw cases with hypothesis, run them in one world, shrink what fails")
    p.add_argument("--examples", type=int, default=DEFAULT_EXAMPLES, help=f"new cases to generate (default "
                   f"{DEFAULT_EXAMPLES}); shrinking a failure runs more")
    p.add_argument("--seed", type=int, default=None, help="makes the run repeatable (default: a random seed, printed)")
    p.add_argument("--models", default="all", help="fixture names, comma separated, or all")
    p.add_argument("--spec", action="append", help="MODULE:FUNCTION taking shape= with a `space` attribute "
                   "(see docs/explore.md); repeat for several")
    p.add_argument("--layouts", default="all", help="layout names in each model's grammar (docs/layouts.md), "
                   "or all for --nproc")
    add_order(p)
    p.add_argument("--nproc", type=int, default=4, help="ranks in the world (default 4)")
    p.add_argument("--backend", default="auto", help="auto|gloo|nccl|neuron")
    p.add_argument("--dtype", default="fp32", help="fp32|bf16|fp16, or a comma list to draw from")
    p.add_argument("--attention-backend", default="auto", help="as for run")
    p.add_argument("--out", default="paracheck-found", help="where found cases are written, and read back "
                   "from to be tried first (default paracheck-found/)")
    p.add_argument("--known-failures", default=None, help="TOML of declared upstream failures, or none "
                   "(default: the file paracheck ships)")
    p.add_argument("--report-json", help="write the JSON report here")
    add_timeout(p)
    p.add_argument("--quiet", action="store_true", help="no line per case: only failures found and the summary")


def explore(args) -> int:
    from paracheck.results import known
    from paracheck.domain.backends import resolve

    dtypes = _check(args)
    backend = resolve(args.backend)
    entries = known.load(known.SHIPPED if args.known_failures is None else args.known_failures)
    targets = _targets(args, dtypes)
    return _explore(args, backend, entries, targets, dtypes)


def _check(args) -> list[str]:
    if args.examples < 1:
        raise UsageError(f"--examples {args.examples}: must be >= 1")
    if args.nproc < 2:
        raise UsageError(f"--nproc {args.nproc}: explore needs a parallel layout, so 2 or more ranks")
    check_order(args.order)
    args.timeout = check_timeout(args.timeout)
    dtypes = check_dtypes(args.dtype, several=True)
    check_writable(args.report_json, "--report-json")
    args.seed = random.randrange(2 ** 16) if args.seed is None else args.seed
    return dtypes


def _targets(args, dtypes: list[str]) -> list:
    """The models to draw, each with the layouts of `--layouts` it has a plan for (read with its library's
    grammar; `all` for any)."""
    from paracheck.domain.registry import library_of

    named = named_models(args)
    libraries = {factory: library_of(factory) for _, factory in named}
    for library in dict.fromkeys(libraries.values()):
        problem = registry.adapter(library).unsupported()
        if problem:
            raise UsageError(problem)
    texts = _layouts_by_library(args, set(libraries.values()))
    targets = [_target(args, name, factory, libraries[factory], texts[libraries[factory]], dtypes)
               for name, factory in named]
    targets = [t for t in targets if t.layouts]
    if not targets:
        raise UsageError(f"--layouts {args.layouts}: no model asked for has a plan for any of them")
    return targets


def _layouts_by_library(args, libraries: set[str]) -> dict[str, str]:
    """--layouts per library: all, or the whole text where one library's models are drawn; with several, each
    name goes to every library whose grammar reads it (`tp4` is several), and a name none reads is an error."""
    if args.layouts.strip() == "all" or len(libraries) == 1:
        return dict.fromkeys(libraries, args.layouts)
    texts: dict[str, list[str]] = {library: [] for library in libraries}
    for item in (i.strip() for i in args.layouts.split(",")):
        readers = []
        for library in sorted(libraries):
            try:
                registry.parse_layout(library, item, args.order)
                readers.append(library)
            except ValueError:
                pass
        if not readers:
            raise UsageError(f"--layouts {item!r}: no grammar of {', '.join(sorted(libraries))} reads it "
                             "(see docs/layouts.md)")
        for library in readers:
            texts[library].append(item)
    return {library: ",".join(items) for library, items in texts.items()}


def _target(args, name: str, factory: str, library: str, layouts_text: str, dtypes: list[str]):
    """A model through its adapter's explore face: its space and the layouts of `layouts_text` (in its grammar)
    it builds."""
    from paracheck.explore.engine import Target

    adapter = registry.adapter(library)
    if not set(dtypes) & set(adapter.dtypes):
        if args.models != "all" or args.spec:  # asked for: say why it cannot run
            raise UsageError(f"--dtype {args.dtype}: the {library} adapter runs {', '.join(adapter.dtypes)} only; "
                             f"add one of them to draw {name}")
        return Target(name, factory, None, (), library)
    if not layouts_text:
        return Target(name, factory, None, (), library)
    try:
        space, layouts = adapter.explore_target(factory, layouts_text, args.nproc, args.order)
    except SpecError:
        raise
    except ValueError as exc:  # a layout name its grammar refuses, or one of another world size
        raise UsageError(str(exc)) from exc
    return Target(name, factory, space, tuple(layouts), library, adapter.draw_options)


def _explore(args, backend, entries, targets, dtypes) -> int:
    from paracheck.explore import engine as explore
    from paracheck.explore import found
    from paracheck.launch.launcher import Feeder

    earlier = found.read(args.out)
    names = ", ".join(f"{t.name} ({','.join(l.name for l in t.layouts)})" for t in targets)
    print(f"paracheck explore --seed {args.seed}: {args.examples} examples over {names}"
          + (f"; {len(earlier)} found before in {args.out}, tried first" if earlier else ""), flush=True)
    started = time.time()
    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        with Feeder(backend, args.nproc, args.timeout) as feeder:
            explorer = explore.Explorer(feeder, entries, args.attention_backend,
                                        on_case=_Lines(args.quiet, started).case)
            explore.run(explorer, explore.draws(targets, dtypes), args.seed, args.examples, earlier)
    except KeyboardInterrupt:
        print("paracheck: interrupted; every rank was stopped", file=sys.stderr)
        return Exit.BROKEN
    finally:
        signal.signal(signal.SIGTERM, previous)
    return _finish(args, explorer, run_meta(backend, args.nproc), time.time() - started, feeder.worlds)


class _Lines:
    """A line per case run (examples so far, failures found, seconds), or only the failures with --quiet."""

    def __init__(self, quiet: bool, started: float):
        self.quiet, self.started = quiet, started

    def case(self, verdict, explorer) -> None:
        from paracheck.explore.engine import signature
        from paracheck.domain.records import CheckId

        failing = signature(verdict) is not None
        if self.quiet and not failing:
            return
        forward = verdict.check(CheckId.FORWARD)
        figure = f"max_abs {forward.max_abs:.1e}" if forward is not None and forward.max_abs is not None else ""
        print(f"[{explorer.ran} run, {len(explorer.found)} found, {time.time() - self.started:.0f}s] "
              f"{verdict.id} ({verdict.case.shape.describe()}{', ' + verdict.case.dtype}): {verdict.status.value}"
              f"{' ' + figure if figure else ''}", flush=True)


def _finish(args, explorer, meta: RunMeta, seconds: float, worlds: int) -> int:
    from paracheck.explore import found as found_files

    rows = []
    for f in explorer.found.values():
        spec, command = found_files.write(args.out, f, args.nproc, None if args.backend == "auto" else args.backend,
                                          args.known_failures == "none", meta.versions)
        rows.append({"signature": f.signature, "case": f.case.id, "shape": f.case.shape.describe(),
                     "dtype": f.case.dtype, "cp_options": dict(f.case.cp_options), "detail": f.detail,
                     "spec": spec, "replay": command})
    print()
    for row in rows:
        print(f"FOUND {row['signature']}\n      minimal: {row['case']}: {row['shape']}, {row['dtype']}, "
              f"CP options {row['cp_options'] or 'none'}\n      {row['detail']}\n      spec: {row['spec']}\n"
              f"      replay: {row['replay']}")
    for text, count in explorer.known_hits.most_common():
        print(f"known ({count} cases): {text}")
    for event in explorer.events:
        print(f"RUN BROKE ({event.kind}): {event.message}")
    code = Exit.FAILED if rows else Exit.OK
    if any(e.kind == "start" for e in explorer.events):
        code = Exit.BROKEN
    per_case = seconds / max(explorer.ran, 1)
    by_status = ", ".join(f"{n} {s}" for s, n in sorted(explorer.statuses.items()))
    ran = f"{explorer.ran} cases run" + (f" ({by_status})" if by_status else "")
    print(f"\n{len(rows)} failures found, {sum(explorer.known_hits.values())} known, {ran} in {seconds:.1f}s "
          f"({per_case:.2f}s per case, {worlds} world{'s' if worlds != 1 else ''}); "
          f"replay this run with --seed {args.seed}")
    if args.report_json:
        data = dict(meta.to_json(), command="explore", seed=args.seed, examples=args.examples, cases_run=explorer.ran,
                    statuses=dict(explorer.statuses),
                    seconds=round(seconds, 2), seconds_per_case=round(per_case, 3), worlds=worlds, found=rows,
                    known={text: count for text, count in explorer.known_hits.items()},
                    events=[{"kind": e.kind, "message": e.message} for e in explorer.events], exit_code=int(code))
        write_report(args.report_json, data)
    return code
