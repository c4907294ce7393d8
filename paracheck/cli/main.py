"""The command line: `paracheck run`, `paracheck explore`, `paracheck topology`. Exit codes are `protocol.Exit`.

Parsing, usage errors and `topology` import no torch; `run` imports it only to load `--spec` factories.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from paracheck import __version__
from paracheck.domain.backends import BackendError, get_backend, missing_devices, resolve
from paracheck.domain.case import (ROUTES, Case, FixtureUnavailable, SpecError, call_factory, expand,
                                   parse_cp_options)
from paracheck.cli.common import (UsageError, add_order, add_timeout, check_choice, check_dtypes, check_order,
                                  check_timeout, check_writable, named_models, raise_interrupt)
from paracheck.results.report import run_meta
from paracheck.adapters import controls as adapter_controls
from paracheck.adapters.diffusers.controls import CONTROLS
from paracheck.domain.layout import Layout, LayoutError, layouts_for, parse_layouts
from paracheck.launch.protocol import Exit


def parser() -> argparse.ArgumentParser:
    """The command line of every command (public for tests that build cases in process)."""
    parser = argparse.ArgumentParser(prog="paracheck", description="Parallel correctness checks for diffusers and transformers models.")
    parser.add_argument("--version", action="version", version=f"paracheck {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run models over layouts and check every rank against one device")
    run.add_argument("--backend", default="auto", help="auto|gloo|nccl|neuron (auto: nccl with CUDA devices, neuron with "
                     "Neuron devices, else gloo)")
    run.add_argument("--nproc", type=int, default=None, help="ranks in the world (default 4; under torchrun "
                     "its WORLD_SIZE)")
    run.add_argument("--models", default="all", help="fixture names, comma separated; all (every library's, "
                     "the transformers ones where transformers is installed), diffusers or transformers")
    run.add_argument("--layouts", default="all", help="layouts like tp4,u4,tp2xu2, or all for --nproc")
    run.add_argument("--route", default="auto", help="auto|native|composed|sharded-load")
    add_order(run)
    run.add_argument("--spec", action="append", help="MODULE:FUNCTION returning (model_class, init_dict, inputs), or "
                     "with library = 'transformers' (a found transformers case) (fixture, shape); repeat for several")
    run.add_argument("--no-grads", action="store_true", help="skip parity.grads")
    run.add_argument("--controls", action="store_true", help="also run every negative control")
    run.add_argument("--only-control", help="with --controls: run this control alone (and no plain cases)")
    run.add_argument("--dtype", default="fp32", help="fp32|bf16|fp16: the dtype the models run in")
    run.add_argument("--attention-backend", default="auto", help="auto (CPU: paracheck's attention op, which "
                     "returns the log-sum-exp ring needs; GPUs: native, or for ring the first usable of _native_cudnn, "
                     "_native_flash, flash, sage) or a diffusers attention backend name")
    run.add_argument("--variants", default=None, help="input variants: all, or some of base,batch2,masked,uneven,"
                     "left_pad,right_pad,packed,embeds (each model runs the ones it offers); unset: every variant "
                     "of the diffusers fixtures, base inputs of the transformers ones")
    run.add_argument("--cp-options", default="", help="the library's context-parallel options for every CP "
                     "layout, name=value comma separated: ulysses_anything, ring_anything (true|false), "
                     "rotate_method (allgather|alltoall), convert_to_fp32 (true|false)")
    run.add_argument("--known-failures", default=None, help="TOML of declared upstream failures, or none "
                     "(default: the file paracheck ships)")
    run.add_argument("--report-json", help="write the JSON report here")
    run.add_argument("--junit", help="write JUnit XML here")
    run.add_argument("--html", help="write the HTML report here (one self-contained file, opens offline)")
    add_timeout(run)
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
    from paracheck.cli.topology import add_arguments

    add_arguments(topo)
    return parser


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

            check_library()
            return explore(args)
        return run(args)
    except (UsageError, LayoutError, BackendError, SpecError, KnownFailuresError) as exc:
        print(f"paracheck: error: {exc}", file=sys.stderr)
        return Exit.USAGE


def _check_options(args, backend, diffusers: bool = True) -> list[Layout]:
    world = os.environ.get("WORLD_SIZE") if "RANK" in os.environ else None
    if world is not None and args.nproc not in (None, int(world)):
        raise UsageError(f"--nproc {args.nproc}: under torchrun the world is WORLD_SIZE={world}; drop --nproc")
    args.nproc = int(world) if world is not None else (4 if args.nproc is None else args.nproc)
    if args.nproc < 1:
        raise UsageError(f"--nproc {args.nproc}: must be >= 1")
    missing = missing_devices(backend, int(os.environ.get("LOCAL_WORLD_SIZE", args.nproc)))
    if missing:
        raise UsageError(missing)
    _wanted_variants(args.variants)
    _check_attention_backend(args.attention_backend)
    check_order(args.order)
    check_choice("--route", args.route, ROUTES)
    check_dtypes(args.dtype)
    check_timeout(args.timeout)
    try:
        args.cp_options = parse_cp_options(args.cp_options)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    every_control = adapter_controls()
    if args.only_control and args.only_control not in every_control:
        raise UsageError(f"--only-control {args.only_control!r}: must be one of {', '.join(every_control)}")
    if args.only_control and not args.controls:
        raise UsageError("--only-control needs --controls")
    if not diffusers:  # transformers models only: their adapter reads --layouts (`_transformers_cases`)
        return []
    layouts = parse_layouts(args.layouts, args.nproc, args.order)
    if not layouts:
        raise UsageError(f"--nproc {args.nproc}: one rank has no parallel layout; use --nproc 2 or more")
    return layouts


def _check_attention_backend(name: str) -> None:
    """A name other than auto or paracheck's own is checked against diffusers' list (importing it, so
    only then)."""
    if name in ("auto", "paracheck_cpu_lse"):
        return
    from diffusers.models.attention_dispatch import AttentionBackendName

    names = [b.value for b in AttentionBackendName]
    if name not in names:
        raise UsageError(f"--attention-backend {name!r}: must be auto, paracheck_cpu_lse or one of diffusers' "
                         f"backends ({', '.join(names)})")


def build_cases(args, backend) -> list[Case]:
    from paracheck.adapters.fixtures import library_of

    models = named_models(args)
    adapted = [(m, f) for m, f in models if library_of(f) != "diffusers"]
    models = [(m, f) for m, f in models if library_of(f) == "diffusers"]
    layouts = _check_options(args, backend, diffusers=bool(models))
    # fail fast, exit 2, before any rank starts
    built = {factory: call_factory(factory) for _, factory in models} if args.spec else {}
    if args.layouts.strip() != "all" and (args.spec or args.models != "all"):
        _check_fits(models, layouts, built)
    # Every control on every layout: one that cannot apply is reported as skipped, with the reason.
    controls = [args.only_control] if args.only_control else (list(CONTROLS) if args.controls else [])
    controls = [c for c in controls if c in CONTROLS]  # an adapter's controls go to its own models only
    wanted = _wanted_variants(args.variants)
    # Unset --variants: the transformers fixtures' base inputs (their other variants on --variants all or by name).
    tf_wanted = ["base"] if args.variants is None else wanted
    return _transformers_cases(args, adapted, tf_wanted) + [case for model, factory in models
            for case in expand(model, factory, layouts, lambda layout: controls, plain=not args.only_control,
                               variants=[v for v in _offered(model, factory) if v in wanted],
                               route=args.route, grads=not args.no_grads, dtype=args.dtype, cp_options=args.cp_options,
                               attention_backend=args.attention_backend)]


def _transformers_cases(args, models, wanted) -> list[Case]:
    """The transformers fixtures' cases (`wanted` variants), and each transformers `--spec`'s (the variants it
    offers, all of them where --variants is unset, as for a diffusers spec)."""
    from paracheck.adapters.transformers.cases import expand as transformers_expand, factory_of
    from paracheck.adapters.transformers.layout import TfLayoutError

    cases = []
    try:
        for model, factory in models:
            spec = None if factory == factory_of(model) else factory
            cases += transformers_expand(model, args.layouts, args.nproc, _wanted_variants(args.variants) if spec
                                         else wanted, args.controls, args.only_control, not args.no_grads, spec)
    except TfLayoutError as exc:
        raise UsageError(str(exc)) from exc
    return cases


def _wanted_variants(text: str | None) -> list[str]:
    from paracheck.adapters.transformers.fixtures import VARIANTS as TRANSFORMERS_VARIANTS
    from paracheck.adapters.diffusers.fixtures_index import VARIANTS as DIFFUSERS_VARIANTS

    VARIANTS = (*DIFFUSERS_VARIANTS, *(v for v in TRANSFORMERS_VARIANTS if v not in DIFFUSERS_VARIANTS))
    if text is None or text.strip() == "all":
        return list(VARIANTS)
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        raise UsageError(f"--variants {text!r}: {', '.join(unknown) or 'empty'}: variants are {', '.join(VARIANTS)} "
                         "(or all)")
    return names


def _offered(model: str, factory: str) -> tuple[str, ...]:
    from paracheck.domain.case import factory_variants
    from paracheck.adapters.diffusers.fixtures_index import FIXTURE_VARIANTS, FIXTURES

    if FIXTURES.get(model) == factory:
        return FIXTURE_VARIANTS.get(model, ("base",))
    return factory_variants(factory)


def _check_fits(models: list[tuple[str, str]], layouts: list[Layout], built: dict) -> None:
    """Named models crossed with named layouts: the pairs that do not fit run as skips with the reason,
    but a named layout that fits none of the models, or a model that takes none of the layouts, is a
    usage error (nothing would run for it)."""
    from paracheck.adapters.diffusers.fitting import Unfittable, fit_init_dict

    misfits: dict[tuple[str, str], str] = {}
    for name, factory in models:
        try:
            model_class, init_dict, _ = built.get(factory) or call_factory(factory)
        except FixtureUnavailable as exc:  # a skip on the ranks, with this reason
            misfits.update({(name, layout.name): str(exc) for layout in layouts})
            continue
        for layout in layouts:
            try:
                fit_init_dict(model_class, init_dict, layout)
            except Unfittable as exc:
                misfits[name, layout.name] = str(exc)
    for name, _ in models:
        if all((name, layout.name) in misfits for layout in layouts):
            reasons = "; ".join(f"{layout.name}: {misfits[name, layout.name]}" for layout in layouts)
            raise UsageError(f"--models {name} takes none of --layouts {','.join(l.name for l in layouts)} ({reasons})")
    for layout in layouts:
        if all((name, layout.name) in misfits for name, _ in models):
            reasons = "; ".join(f"{name}: {misfits[name, layout.name]}" for name, _ in models)
            raise UsageError(f"--layouts {layout.name} fits none of --models "
                             f"{','.join(n for n, _ in models)} ({reasons})")


def check_library() -> None:
    """Exit 2, in one line, on a diffusers the adapter cannot serve (before any rank starts)."""
    from paracheck.adapters.diffusers.library import unsupported

    problem = unsupported()
    if problem:
        raise UsageError(problem)


def run(args) -> int:
    from paracheck.results import known

    backend = resolve(args.backend)
    cases = build_cases(args, backend)
    check_library()
    entries = known.load(known.SHIPPED if args.known_failures is None else args.known_failures)
    check_writable(args.report_json, "--report-json")
    check_writable(args.junit, "--junit")
    check_writable(args.html, "--html")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        from paracheck.rank.torchrun import run_as_rank

        return run_as_rank(args, backend, cases, entries)
    return _launch(args, backend, cases, entries)


def _launch(args, backend, cases: list[Case], entries) -> int:
    from paracheck.launch.launcher import Launcher
    from paracheck.results.progress import Progress

    progress = Progress(cases, quiet=args.quiet, entries=entries)
    launcher = Launcher(backend, args.nproc, args.timeout, on_case=progress.case_done)
    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    started = time.time()
    try:
        outcome = launcher.run(cases)
    except KeyboardInterrupt:
        launcher.stop()
        progress.close()
        print("paracheck: interrupted; every rank was stopped", file=sys.stderr)
        return Exit.BROKEN
    finally:
        signal.signal(signal.SIGTERM, previous)
    progress.close()
    meta = run_meta(backend, args.nproc, outcome)
    from paracheck.results.finish import finish

    return finish(args, cases, [outcome.results[i] for i in range(len(cases))], outcome.events, entries, meta,
                  time.time() - started, f", ranks {outcome.start_method}, {outcome.references} references")


def topology(args) -> int:
    from paracheck.domain.layout import fit_heads
    from paracheck.cli.topology import reject_simulate_only, topology_simulate

    if args.simulate:
        return topology_simulate(args)
    reject_simulate_only(args)
    if args.heads is None:
        raise UsageError("--heads: required without --simulate (with --simulate the model's config gives it)")
    backend = get_backend(args.backend)
    if args.world < 1:
        raise UsageError(f"--world {args.world}: must be >= 1")
    if args.heads < 1:
        raise UsageError(f"--heads {args.heads}: must be >= 1")
    layouts = parse_layouts(args.layout, args.world, args.order) if args.layout else layouts_for(args.world, args.order)
    bad = 0
    for layout in layouts:
        problems = backend.problems(layout)
        if args.heads % layout.head_multiple:
            problems.append(f"{args.heads} heads: tp x ulysses = {layout.head_multiple} must divide them "
                            f"(nearest fit: {fit_heads(args.heads, layout)})")
        groups = f"tp groups {layout.groups(('tp',))}, cp groups {layout.groups(('ring', 'ulysses'))}"
        print(f"{layout.name:12} {'ok' if not problems else 'no':3} {'; '.join(problems) or groups}")
        bad += bool(problems)
    return Exit.FAILED if args.layout and bad else Exit.OK


if __name__ == "__main__":
    sys.exit(main())
