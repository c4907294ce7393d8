"""Where one case's time goes in a local world (`--local-world N`): `cProfile` over the case as the run calls it.

    python benchmarks/local_profile.py helios u4 [--ranks 4] [--variant base] [--grads] [--out case.prof]

Runs one fixture's case through `rank.localrun.run_local_case` in a `LocalWorld` of N ranks, in this process,
and prints the case's phase timings and the profile's top entries by own and by cumulative time. Only the main
thread is profiled: the per-rank regions' threads (`world.regions`) show as its wait on them. Measured with it:
docs/local-world.md, "Why Helios is slow in one process".
"""

import argparse
import cProfile
import os
import pstats
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("layout")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--variant", default="base")
    parser.add_argument("--grads", action="store_true", help="take the backward too (parity.grads)")
    parser.add_argument("--out", help="write the raw profile here (pstats)")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args(argv)

    import paracheck.fixtures as fixtures
    from paracheck.adapters.diffusers.layout import DiffusersLayout
    from paracheck.domain.backends import get_backend
    from paracheck.domain.case import Case
    from paracheck.rank.localrun import run_local_case
    from paracheck.world.localworld import LocalWorld

    case = Case(args.model, fixtures.FIXTURES[args.model], DiffusersLayout.parse(args.layout), variant=args.variant,
                grads=args.grads, library="diffusers")
    work = tempfile.mkdtemp(prefix="paracheck-profile-")
    os.makedirs(os.path.join(work, "refs"))
    profile = cProfile.Profile()
    wall, cpu = time.time(), time.process_time()
    with LocalWorld(args.ranks) as world:
        profile.enable()
        results = run_local_case(0, case, get_backend("gloo"), world, os.path.join(work, "refs"),
                                 os.path.join(work, "case"))
        profile.disable()
    print(f"{args.model} {args.layout} x{args.ranks}: {time.time() - wall:.1f} s wall, "
          f"{time.process_time() - cpu:.1f} s CPU; status {results[0].status.value}; phases {results[0].timings}")
    if args.out:
        profile.dump_stats(args.out)
    stats = pstats.Stats(profile)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
