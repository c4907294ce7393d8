"""Collectives one forward issues, per rank and process group, in a REAL 4-rank gloo world.

    python benchmarks/collectives_gloo.py [--json out.json] [--cases tp4,u4,tp2xu2,u4:skip-processor-config]

Tiny Flux (the bundled fixture at 4 heads) is parallelized through the kit's routes on every rank (with the
gloo shims), then one forward runs twice: under torch's `CommDebugMode` (which counts collectives but
not their groups), and under `paracheck.adapters.diffusers.collectives.count_collectives` (which keys them by group). Each rank
checks its output against the one-device reference and runs the `structure.collectives` check.
Rank 0 prints one line per case and rank; `--json` writes everything.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import tempfile

import torch

from paracheck.rank.forked import fork_ranks

DEFAULT_CASES = "tp4,u4,tp2xu2,r4,tp2xr2,u4:skip-processor-config,tp2xu2:skip-processor-config,r4:skip-output-gather"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, cases: list[tuple[str, str | None]], outdir: str):
    import warnings

    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    from paracheck.adapters.diffusers import library
    from paracheck.adapters.diffusers.attention import cpu_lse_attention
    from paracheck.domain.backends import get_backend
    from paracheck.adapters.diffusers.collectives import check_counts, count_collectives
    from paracheck.domain.registry import get_control
    from paracheck.fixtures import flux
    from paracheck.adapters.diffusers.layout import DiffusersLayout
    from paracheck.domain.records import Route
    from paracheck.adapters.diffusers.routes import apply, resolve_route

    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    backend = get_backend("gloo")
    cls, init, inputs = flux()
    init = dict(init, num_attention_heads=4)
    torch.manual_seed(0)
    reference = cls(**init).eval()
    with torch.no_grad():
        expected = reference(**inputs, return_dict=False)[0]
    results = []
    for name, control in cases:
        layout = DiffusersLayout.parse(name)
        model = cls(**init).eval()
        model.load_state_dict(reference.state_dict())
        planted = get_control(control) if control else None
        with library.shims(backend.device_type):
            route = resolve_route(Route.AUTO, layout, backend.device_type)
            model, applied = apply(route, model, layout, backend, planted, reference, outdir)
        # Ring needs the attention's log-sum-exp: paracheck's CPU op gives it (diffusers' native one does not).
        ring = cpu_lse_attention() if layout.ring > 1 else contextlib.nullcontext()
        with torch.no_grad(), ring:
            with CommDebugMode() as comm:
                out = model(**inputs, return_dict=False)[0]
            with count_collectives(rank, library.observed_attention) as counts:
                again = model(**inputs, return_dict=False)[0]
            assert torch.equal(out, again)  # uses (and so waits on) the second forward's output too
        check = check_counts(counts, layout)
        results.append({
            "case": name + (f":{control}" if control else ""), "rank": rank,
            "comm_debug_mode": {str(op): n for op, n in comm.get_comm_counts().items()},
            "counts": counts.to_json(), "verdict": check.status, "detail": check.detail,
            "max_abs": float((out - expected).abs().max()) if out.shape == expected.shape else None,
            "shape": list(out.shape),
        })
        dist.barrier()
    with open(os.path.join(outdir, f"{rank}.json"), "w") as handle:
        json.dump(results, handle)
    dist.barrier()
    dist.destroy_process_group()


def run(cases: list[tuple[str, str | None]], world: int = 4) -> list[dict]:
    with tempfile.TemporaryDirectory() as outdir:
        fork_ranks(_worker, (world, _free_port(), cases, outdir), world)
        rows = []
        for rank in range(world):
            with open(os.path.join(outdir, f"{rank}.json")) as handle:
                rows.extend(json.load(handle))
    return sorted(rows, key=lambda r: ([c[0] + (f":{c[1]}" if c[1] else "") for c in cases].index(r["case"]),
                                       r["rank"]))


def parse_cases(text: str) -> list[tuple[str, str | None]]:
    out = []
    for item in text.split(","):
        name, _, control = item.partition(":")
        out.append((name.strip(), control.strip() or None))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=DEFAULT_CASES)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rows = run(parse_cases(args.cases))
    for row in rows:
        comm = ", ".join(f"{n} {op.split('.')[-1]}" for op, n in sorted(row["comm_debug_mode"].items())) or "none"
        error = f"{row['max_abs']:.1e}" if row["max_abs"] is not None else f"shape {row['shape']}"
        print(f"{row['case']:28} rank {row['rank']}  {row['verdict']:4}  max_abs {error}  "
              f"CommDebugMode: {comm}\n{'':36}groups: {row['detail']}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
