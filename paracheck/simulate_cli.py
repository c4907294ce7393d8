"""`paracheck topology --simulate`: the command-line side of `simulate.py`.

Exit codes: 0 every layout simulated as the rules say (with `--layout`: every named layout is ok; with
`--control`: the control was detected wherever it applied), 1 otherwise or when the library built a wrong
structure on any layout, 2 bad usage (the message names the argument and the rule).
"""

from __future__ import annotations

import sys
import time

#: Options that only mean something with --simulate (dest -> flag).
SIMULATE_ONLY = {"models": "--models", "spec": "--spec", "route": "--route", "control": "--control",
                 "collectives": "--collectives", "report_json": "--report-json"}


def add_arguments(topo) -> None:
    """The --simulate options of the `topology` subcommand."""
    topo.add_argument("--simulate", action="store_true",
                      help="build each rank's model on meta under torch's fake process group and check what "
                           "the library really built (no hardware; up to 128 ranks)")
    topo.add_argument("--models", help="with --simulate: fixture names, comma separated, or all (default all)")
    topo.add_argument("--spec", action="append", help="with --simulate: MODULE:FUNCTION returning (model_class, "
                      "init_dict, inputs); e.g. paracheck.sim_specs:flux_dev")
    topo.add_argument("--route", help="with --simulate: auto|native|composed (default auto)")
    topo.add_argument("--control", help="with --simulate: plant this negative control on every rank")
    topo.add_argument("--collectives", action="store_true",
                      help="with --simulate: run one forward on meta tensors and check its collectives per group")
    topo.add_argument("--report-json", help="with --simulate: write the results here")


def reject_simulate_only(args, usage_error) -> None:
    for dest, flag in SIMULATE_ONLY.items():
        if getattr(args, dest, None) not in (None, False):
            raise usage_error(f"{flag}: only with --simulate")


def models_from(args, usage_error) -> list[tuple[str, type, dict, dict]]:
    """(name, model_class, init_dict, inputs) per model asked for, heads overridden by --heads."""
    from .case import call_factory
    from .fixtures_index import FIXTURES
    from .simulate import SimulationError, with_heads

    if args.spec and args.models:
        raise usage_error("--models and --spec: give one or the other")
    if args.spec:
        named = [(spec.rpartition(":")[2], spec) for spec in args.spec]
    else:
        text = args.models or "all"
        names = list(FIXTURES) if text.strip() == "all" else [m.strip() for m in text.split(",") if m.strip()]
        unknown = [n for n in names if n not in FIXTURES]
        if unknown or not names:
            raise usage_error(f"--models {','.join(unknown) or repr(text)}: unknown; fixtures are "
                              f"{', '.join(FIXTURES)} (or all)")
        named = [(n, FIXTURES[n]) for n in names]
    out = []
    for name, factory in named:
        model_class, init_dict, inputs = call_factory(factory)
        try:
            init_dict = with_heads(model_class, init_dict, args.heads)
        except SimulationError as exc:
            raise usage_error(str(exc)) from exc
        out.append((name, model_class, init_dict, inputs))
    return out


def topology_simulate(args, usage_error) -> int:
    from .backends import get_backend
    from .controls import CONTROLS
    from .layout import ORDERS
    from .protocol import Exit
    from .simulate import MAX_WORLD, ROUTES, heads_of, simulate_on, table

    names = [b.strip() for b in args.backend.split(",") if b.strip()]
    backends = [get_backend(name) for name in dict.fromkeys(names)]
    if not backends:
        raise usage_error(f"--backend {args.backend!r}: name one or more of gloo, nccl, neuron")
    if not 2 <= args.world <= MAX_WORLD:
        raise usage_error(f"--world {args.world}: --simulate takes 2 to {MAX_WORLD} ranks")
    if args.order not in ORDERS:
        raise usage_error(f"--order {args.order!r}: must be one of {', '.join(ORDERS)}")
    route = args.route or "auto"
    if route not in ROUTES:
        raise usage_error(f"--route {route!r}: --simulate takes one of {', '.join(ROUTES)} "
                          "(sharded-load reads a checkpoint, which a meta model has none of)")
    if args.control and args.control not in CONTROLS:
        raise usage_error(f"--control {args.control!r}: must be one of {', '.join(CONTROLS)}")
    if args.heads is not None and args.heads < 1:
        raise usage_error(f"--heads {args.heads}: must be >= 1")
    if args.report_json:
        from .cli import _check_writable

        _check_writable(args.report_json, "--report-json")
    layouts = _layouts(args, usage_error)
    models = models_from(args, usage_error)

    started = time.perf_counter()
    report, code, total_ranks, total_cpu = [], 0, 0, 0.0
    for name, model_class, init_dict, inputs in models:
        by_backend = simulate_on(model_class, init_dict, backends, args.world, layouts, order=args.order, route=route,
                                 control=args.control, collectives=args.collectives, inputs=inputs)
        for backend in backends:
            results = by_backend[backend.name]
            print(f"{name} ({model_class.__name__}, {heads_of(model_class, init_dict)} heads) on {backend.name}, "
                  f"world {args.world}, order {args.order}, route {route}"
                  + (f", control {args.control}" if args.control else ""))
            print(table(results))
            for r in results:
                for check, failure in r.failures.items():
                    print(f"  {r.layout}: {check} fails on ranks {_ranks(failure['ranks'])}: {failure['detail']}")
                for note in r.notes:
                    print(f"  {r.layout}: note: {note}")
            code = max(code, _exit_code(results, args))
            report.append({"model": name, "class": model_class.__name__, "backend": backend.name,
                           "heads": heads_of(model_class, init_dict), "results": [r.to_json() for r in results]})
        # One simulation served every backend: count its ranks and time once.
        simulated = [r for r in by_backend[backends[0].name] if r.ranks]
        ranks = sum(r.ranks for r in simulated)
        wall = sum(r.seconds for r in simulated)
        cpu = sum(r.cpu_seconds for r in simulated)
        total_ranks, total_cpu = total_ranks + ranks, total_cpu + cpu
        if ranks:
            print(f"  {ranks} ranks simulated in {wall:.1f} s: {1000 * wall / ranks:.0f} ms/rank wall, "
                  f"{1000 * cpu / ranks:.0f} ms/rank CPU" + (f" (judged by {', '.join(b.name for b in backends)})"
                                                            if len(backends) > 1 else ""))
        print(flush=True)
    elapsed = time.perf_counter() - started
    print(f"{total_ranks} ranks in {elapsed:.1f} s" + (f" ({1000 * total_cpu / total_ranks:.0f} ms CPU per rank)"
                                                       if total_ranks else ""))
    if args.report_json:
        import json

        with open(args.report_json, "w") as handle:
            json.dump({"backends": [b.name for b in backends], "world": args.world, "order": args.order, "route": route,
                       "control": args.control, "models": report, "seconds": round(elapsed, 3)}, handle, indent=1)
    sys.stdout.flush()
    return Exit(code)


def _layouts(args, usage_error):
    from .layout import Layout, layouts_for

    if not args.layout or args.layout.strip() == "all":
        return layouts_for(args.world, args.order)
    layouts = []
    for item in args.layout.split(","):
        layout = Layout.parse(item, args.order)
        if layout.world != args.world:
            raise usage_error(f"--layout {layout.name}: its world size is {layout.world}, but --world is "
                              f"{args.world}; the product of the degrees must equal --world")
        if layout not in layouts:
            layouts.append(layout)
    return layouts


def _exit_code(results, args) -> int:
    if args.control:
        return 1 if any(r.detected is False for r in results) else 0
    if any(r.structure_failed for r in results):
        return 1
    if args.layout and any(r.status != "ok" for r in results):
        return 1
    return 0


def _ranks(ranks) -> str:
    from .simulate import compress

    return compress(ranks)
