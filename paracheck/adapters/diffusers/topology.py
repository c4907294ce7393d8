"""`paracheck topology --simulate`: the command-line side of `simulate.py`, asked by a `TopologyRequest` (the host
owns the options): `--heads`, the tables it prints and the report it writes.

Exit codes: 0 every layout simulated as the rules say (with `--layout`: every named layout is ok; with
`--control`: the control was detected wherever it applied), 1 otherwise or when the library built a wrong
structure on any layout, 2 bad usage (the message names the argument and the rule).
"""

from __future__ import annotations

import sys
import time

from paracheck.cli.common import UsageError, check_order, check_writable
from paracheck.domain.adapter import TopologyRequest
from paracheck.results.report import write_report

#: `topology`'s names for the layouts and the world size, which a layout error names.
TOPOLOGY_FLAGS = ("--layout", "--world")


def models_from(request) -> list[tuple[str, type, dict, dict]]:
    """(name, model_class, init_dict, inputs) per model asked for, heads overridden by --heads."""
    from paracheck.domain.case import call_factory
    from paracheck.adapters.diffusers.fixtures_index import FIXTURES
    from paracheck.adapters.diffusers.simulate.engine import SimulationError

    if request.spec and request.models:
        raise UsageError("--models and --spec: give one or the other")
    if request.spec:
        named = [(spec.rpartition(":")[2], spec) for spec in request.spec]
    else:
        text = request.models or "all"
        names = list(FIXTURES) if text.strip() == "all" else [m.strip() for m in text.split(",") if m.strip()]
        unknown = [n for n in names if n not in FIXTURES]
        if unknown or not names:
            raise UsageError(f"--models {','.join(unknown) or repr(text)}: unknown; fixtures are "
                              f"{', '.join(FIXTURES)} (or all)")
        named = [(n, FIXTURES[n]) for n in names]
    out = []
    for name, factory in named:
        model_class, init_dict, inputs = call_factory(factory)
        try:
            init_dict = with_heads(model_class, init_dict, request.heads)
        except SimulationError as exc:
            raise UsageError(str(exc)) from exc
        out.append((name, model_class, init_dict, inputs))
    return out


def topology_simulate(request: TopologyRequest) -> int:
    from paracheck.launch.protocol import Exit
    from paracheck.adapters.diffusers.simulate.engine import simulate_on

    backends, route = _validated(request)
    layouts = _layouts(request)
    models = models_from(request)
    started = time.perf_counter()
    report, code, total_ranks, total_cpu = [], 0, 0, 0.0
    for name, model_class, init_dict, inputs in models:
        by_backend = simulate_on(model_class, init_dict, backends, request.world, layouts, order=request.order,
                                 route=route, control=request.control, collectives=request.collectives, inputs=inputs)
        for backend in backends:
            results = by_backend[backend.name]
            _print_results(name, model_class, init_dict, backend, results, request, route)
            code = max(code, _exit_code(results, request))
            report.append({"model": name, "class": model_class.__name__, "backend": backend.name,
                           "heads": heads_of(model_class, init_dict), "results": [r.to_json() for r in results]})
        ranks, cpu = _print_cost(by_backend[backends[0].name], backends)
        total_ranks, total_cpu = total_ranks + ranks, total_cpu + cpu
    elapsed = time.perf_counter() - started
    print(f"{total_ranks} ranks in {elapsed:.1f} s" + (f" ({1000 * total_cpu / total_ranks:.0f} ms CPU per rank)"
                                                       if total_ranks else ""))
    if request.report_json:
        write_report(request.report_json, {"backends": [b.name for b in backends], "world": request.world,
                                           "order": request.order, "route": route, "control": request.control,
                                           "models": report, "seconds": round(elapsed, 3)})
    sys.stdout.flush()
    return Exit(code)


def _validated(request):
    """(the backends, the route) the options name; a usage error names the bad option and its rule."""
    from paracheck.domain.backends import get_backend
    from paracheck.adapters.diffusers.controls import CONTROLS
    from paracheck.adapters.diffusers.simulate.engine import MAX_WORLD, ROUTES

    names = [b.strip() for b in request.backend.split(",") if b.strip()]
    backends = [get_backend(name) for name in dict.fromkeys(names)]
    if not backends:
        raise UsageError(f"--backend {request.backend!r}: name one or more of gloo, nccl, neuron")
    if not 2 <= request.world <= MAX_WORLD:
        raise UsageError(f"--world {request.world}: --simulate takes 2 to {MAX_WORLD} ranks")
    check_order(request.order)
    route = request.route or "auto"
    if route not in ROUTES:
        raise UsageError(f"--route {route!r}: --simulate takes one of {', '.join(ROUTES)} "
                          "(sharded-load reads a checkpoint, which a meta model has none of)")
    if request.control and request.control not in CONTROLS:
        raise UsageError(f"--control {request.control!r}: must be one of {', '.join(CONTROLS)}")
    if request.heads is not None and request.heads < 1:
        raise UsageError(f"--heads {request.heads}: must be >= 1")
    check_writable(request.report_json, "--report-json")
    return backends, route


def _print_results(name, model_class, init_dict, backend, results, request, route) -> None:
    print(f"{name} ({model_class.__name__}, {heads_of(model_class, init_dict)} heads) on {backend.name}, "
          f"world {request.world}, order {request.order}, route {route}"
          + (f", control {request.control}" if request.control else ""))
    print(table(results))
    for r in results:
        for check, failure in r.failures.items():
            print(f"  {r.layout}: {check} fails on {_ranks(failure['ranks'])}: {failure['detail']}")
        for note in r.notes:
            print(f"  {r.layout}: note: {note}")


def _print_cost(results, backends) -> tuple[int, float]:
    """One simulation served every backend: its ranks and time, counted once. Returns (ranks, CPU seconds)."""
    simulated = [r for r in results if r.ranks]
    ranks = sum(r.ranks for r in simulated)
    wall = sum(r.seconds for r in simulated)
    cpu = sum(r.cpu_seconds for r in simulated)
    if ranks:
        print(f"  {ranks} ranks simulated in {wall:.1f} s: {1000 * wall / ranks:.0f} ms/rank wall, "
              f"{1000 * cpu / ranks:.0f} ms/rank CPU" + (f" (judged by {', '.join(b.name for b in backends)})"
                                                        if len(backends) > 1 else ""))
    print(flush=True)
    return ranks, cpu


def topology_layouts(backend, world: int, heads: int, layouts: str | None, order: str) -> list:
    """`paracheck topology` without --simulate: [(layout name, problems, its groups)] for every layout of `world`
    ranks (or those `layouts` names) by `backend`'s rules and the head count `heads`."""
    from paracheck.adapters.diffusers.layout import (CP_DIMS, backend_problems, head_multiple, heads_unfit,
                                                     layouts_for, parse_layouts)

    rows = []
    for layout in parse_layouts(layouts, world, order, TOPOLOGY_FLAGS) if layouts else layouts_for(world, order):
        problems = backend_problems(backend, layout)
        if heads % head_multiple(layout):
            problems.append(heads_unfit(heads, layout))
        rows.append((layout.name, problems, f"tp groups {layout.groups(('tp',))}, cp groups {layout.groups(CP_DIMS)}"))
    return rows


def _layouts(request):
    from paracheck.adapters.diffusers.layout import parse_layouts

    return parse_layouts(request.layout or "all", request.world, request.order, TOPOLOGY_FLAGS)


def _exit_code(results, request) -> int:
    from paracheck.adapters.diffusers.simulate.engine import LayoutStatus

    if request.control:
        return 1 if any(r.detected is False for r in results) else 0
    if any(r.structure_failed for r in results):
        return 1
    if request.layout and any(r.status != LayoutStatus.OK for r in results):
        return 1
    return 0


def _ranks(ranks) -> str:
    from paracheck.launch.attribution import ranks_named

    return ranks_named(ranks)


# -- heads --------------------------------------------------------------------------------------------


def with_heads(model_class: type, init_dict: dict, heads: int | None) -> dict:
    """`init_dict` with `num_attention_heads` set to `heads` (and what the model ties to heads x head_dim)."""
    import inspect

    from paracheck.adapters.diffusers.fitting import HEAD_DIM_KEY, HEADS_KEY, TIED_TO_INNER_DIM, init_value
    from paracheck.adapters.diffusers.simulate.engine import SimulationError

    if heads is None:
        return dict(init_dict)
    if heads < 1:
        raise SimulationError(f"--heads {heads}: must be >= 1")
    if HEADS_KEY not in inspect.signature(model_class.__init__).parameters:
        raise SimulationError(f"--heads {heads}: {model_class.__name__} takes no {HEADS_KEY}")
    out = dict(init_dict, **{HEADS_KEY: heads})
    head_dim = init_value(model_class, out, HEAD_DIM_KEY)
    for key in TIED_TO_INNER_DIM.get(model_class.__name__, ()):
        if isinstance(head_dim, int):
            out[key] = heads * head_dim
    return out


def heads_of(model_class: type, init_dict: dict):
    from paracheck.adapters.diffusers.fitting import HEADS_KEY, init_value

    return init_value(model_class, init_dict, HEADS_KEY)


# -- the table ----------------------------------------------------------------------------------------


def short_name(check) -> str:
    """A simulated check's column (the kit's short name); `simulate.apply` when the route itself raised."""
    from paracheck.domain.records import CheckId

    try:
        return CheckId(check).short
    except ValueError:
        return str(check)


def short_reason(result) -> str:
    """The table's reason: failing checks by rank (their details follow the table), or why not simulated."""
    if not result.failures:
        return result.reason
    return "; ".join(f"{short_name(c)} fails on {_ranks(f['ranks'])}" for c, f in result.failures.items())


def _cell(result, check) -> str:
    merged = result.checks.get(check)
    return "-" if merged is None else {"fail": "FAIL", "pass": "ok"}.get(merged.status.value, "-")


def _row(r) -> list[str]:
    from paracheck.adapters.diffusers.simulate.engine import SIM_CHECKS

    status = r.status.value
    if r.control:
        status = f"{status} ({'detected' if r.detected else 'MISSED' if r.detected is False else status})"
    return ([r.layout.name, status] + [_cell(r, c) for c in SIM_CHECKS]
            + [str(r.ranks or "-"), f"{1000 * r.per_rank:.0f}" if r.ranks else "-",
               f"{1000 * r.cpu_per_rank:.0f}" if r.ranks else "-", short_reason(r)])


def table(results) -> str:
    """One row per layout: verdict, each check's cell, ranks simulated, time per rank, reason."""
    from paracheck.adapters.diffusers.simulate.engine import SIM_CHECKS

    header = ["layout", "verdict"] + [short_name(c) for c in SIM_CHECKS] + ["ranks", "ms/rank", "cpu ms", "reason"]
    rows = [_row(r) for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    widths[-1] = 0
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip(),
             "  ".join("-" * max(w, len(h)) for h, w in zip(header, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)
