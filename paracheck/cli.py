"""`paracheck run` and `paracheck topology`. Exit codes: 0 pass, 1 check failed, 2 usage, 3 run broke."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from . import __version__
from .backends import BackendError, device_limit, get_backend, resolve
from .case import ROUTES, Case, SpecError, call_factory, expand
from .controls import CONTROLS
from .layout import ORDERS, Layout, LayoutError, layouts_for, parse_layouts

USAGE, BROKEN = 2, 3


class UsageError(Exception):
    """Bad input: exit 2 with a message naming the argument and the rule."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paracheck", description="Parallel-inference correctness checks for diffusers.")
    parser.add_argument("--version", action="version", version=f"paracheck {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run models over layouts and check every rank against one device")
    run.add_argument("--backend", default="auto", help="auto|gloo|nccl|neuron (auto: nccl with CUDA, else gloo)")
    run.add_argument("--nproc", type=int, default=4, help="ranks in the world (default 4)")
    run.add_argument("--models", default="all", help="fixture names, comma separated, or all")
    run.add_argument("--layouts", default="all", help="layouts like tp4,u4,tp2xu2, or all for --nproc")
    run.add_argument("--route", default="auto", help="auto|native|composed|sharded-load")
    run.add_argument("--order", default="cp-fastest", help="cp-fastest|tp-fastest (mesh order)")
    run.add_argument("--spec", action="append", help="MODULE:FUNCTION returning (model_class, init_dict, inputs); "
                     "repeat for several")
    run.add_argument("--no-grads", action="store_true", help="skip parity.grads")
    run.add_argument("--controls", action="store_true", help="also run every negative control")
    run.add_argument("--only-control", help="with --controls: run this control alone (and no plain cases)")
    run.add_argument("--report-json", help="write the JSON report here")
    run.add_argument("--junit", help="write JUnit XML here")
    run.add_argument("--timeout", type=float, default=120.0, help="seconds one case may run before it is a hang")
    topo = sub.add_parser("topology", help="which layouts a backend can run for a world size and head count")
    topo.add_argument("--backend", required=True)
    topo.add_argument("--world", type=int, required=True)
    topo.add_argument("--heads", type=int, help="attention heads (required without --simulate; with it, "
                      "overrides the model config's num_attention_heads)")
    topo.add_argument("--layout")
    topo.add_argument("--order", default="cp-fastest")
    from .simulate_cli import add_arguments

    add_arguments(topo)
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "topology":
            return topology(args)
        return run(args)
    except (UsageError, LayoutError, BackendError, SpecError) as exc:
        print(f"paracheck: error: {exc}", file=sys.stderr)
        return USAGE


def build_cases(args, backend) -> list[Case]:
    from .fixtures_index import FIXTURES

    if args.nproc < 1:
        raise UsageError(f"--nproc {args.nproc}: must be >= 1")
    limit = device_limit(backend)
    if limit is not None and args.nproc > limit:
        raise UsageError(f"--nproc {args.nproc}: backend {backend.name} sees only {limit} devices here")
    if args.order not in ORDERS:
        raise UsageError(f"--order {args.order!r}: must be one of {', '.join(ORDERS)}")
    if args.route not in ROUTES:
        raise UsageError(f"--route {args.route!r}: must be one of {', '.join(ROUTES)}")
    if args.timeout <= 0:
        raise UsageError(f"--timeout {args.timeout:g}: must be > 0 seconds")
    if args.only_control and args.only_control not in CONTROLS:
        raise UsageError(f"--only-control {args.only_control!r}: must be one of {', '.join(CONTROLS)}")
    if args.only_control and not args.controls:
        raise UsageError("--only-control needs --controls")
    layouts = parse_layouts(args.layouts, args.nproc, args.order)
    if not layouts:
        raise UsageError(f"--nproc {args.nproc}: one rank has no parallel layout; use --nproc 2 or more")
    built = {}
    if args.spec:
        built = {spec: call_factory(spec) for spec in args.spec}  # fail fast, exit 2, before any rank starts
        models = [(spec.rpartition(":")[2], spec) for spec in args.spec]
    else:
        names = list(FIXTURES) if args.models == "all" else [m.strip() for m in args.models.split(",")]
        unknown = [n for n in names if n not in FIXTURES]
        if unknown:
            raise UsageError(f"--models {','.join(unknown)}: unknown; fixtures are {', '.join(FIXTURES)} (or all)")
        models = [(n, FIXTURES[n]) for n in names]
    if args.layouts.strip() != "all" and (args.spec or args.models != "all"):
        _check_fits(models, layouts, built)
    # Every control on every layout: one that cannot apply is reported as skipped, with the reason.
    controls = [args.only_control] if args.only_control else (list(CONTROLS) if args.controls else [])
    return [case for model, factory in models
            for case in expand(model, factory, layouts, lambda layout: controls, plain=not args.only_control,
                               route=args.route, grads=not args.no_grads)]


def _check_fits(models: list[tuple[str, str]], layouts: list[Layout], built: dict) -> None:
    """A model and layout both named on the command line must fit; from `all`, misfits are skipped instead."""
    from .fitting import Unfittable, fit_init_dict

    for name, factory in models:
        model_class, init_dict, _ = built.get(factory) or call_factory(factory)
        for layout in layouts:
            try:
                fit_init_dict(model_class, init_dict, layout)
            except Unfittable as exc:
                raise UsageError(f"--layouts {layout.name} with {name}: {exc}") from exc


def _check_writable(path: str | None, flag: str) -> None:
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UsageError(f"{flag} {path}: not writable")


def run(args) -> int:
    from . import report
    from .launch import Launcher

    backend = resolve(args.backend)
    cases = build_cases(args, backend)
    _check_writable(args.report_json, "--report-json")
    _check_writable(args.junit, "--junit")
    launcher = Launcher(backend, args.nproc, args.timeout)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    started = time.time()
    try:
        outcome = launcher.run(cases)
    except KeyboardInterrupt:
        launcher.stop()
        print("paracheck: interrupted; every rank was stopped", file=sys.stderr)
        return BROKEN
    finally:
        signal.signal(signal.SIGTERM, previous)
    entries = [report.merge_case(c, outcome.results[i]) for i, c in enumerate(cases)]
    extra = [] if args.backend == "auto" else ["--backend", args.backend]
    extra += ["--nproc", str(args.nproc)] + (["--no-grads"] if args.no_grads else [])
    replays = [report.replay_command(c, extra) for c in cases]
    print(report.table(entries))
    text = report.notes(entries, replays)
    if text:
        print("\n" + text)
    for event in outcome.events:
        print(f"\nRUN BROKE ({event.kind}): {event.message}")
    data = report.to_json(entries, _meta(backend, args.nproc), outcome.events)
    summary = data["summary"]
    print(f"\n{summary['passed']} passed, {summary['failed']} failed, {summary['errors']} errors, "
          f"{summary['skipped']} skipped" + (f", {summary['detected']} detected, {summary['missed']} missed"
                                             if args.controls else "")
          + f" in {time.time() - started:.1f}s ({outcome.worlds} world{'s' if outcome.worlds > 1 else ''})")
    if args.report_json:
        import json

        with open(args.report_json, "w") as handle:
            json.dump(data, handle, indent=1)
    if args.junit:
        with open(args.junit, "w") as handle:
            handle.write(report.to_junit(entries))
    return data["exit_code"]


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _meta(backend, nproc: int) -> dict:
    from importlib.metadata import version

    versions = {}
    for package in ("torch", "diffusers"):
        try:
            versions[package] = version(package)
        except Exception:
            versions[package] = None
    return {"paracheck": __version__, "backend": backend.name, "nproc": nproc, "versions": versions}


def topology(args) -> int:
    from .layout import fit_heads
    from .simulate_cli import reject_simulate_only, topology_simulate

    if args.simulate:
        return topology_simulate(args, UsageError)
    reject_simulate_only(args, UsageError)
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
    return 1 if args.layout and bad else 0


if __name__ == "__main__":
    sys.exit(main())
