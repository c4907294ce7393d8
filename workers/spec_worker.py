"""torchrun entry point, runnable by path:

    python -m torch.distributed.run --nproc_per_node=4 workers/spec_worker.py MODULE:FUNCTION --layout tp2xu2

The user's factory (returning `(model_class, init_dict, inputs)`) on one layout: `paracheck run --spec`
as one rank of torchrun's world, so it shares the rank setup, the checks and the verdict rule. Every rank
prints one line per case; rank 0 prints the table. Exit codes as `paracheck run`.
"""

import argparse
import sys

from paracheck.cli.main import main


def _args(argv):
    parser = argparse.ArgumentParser(prog="spec_worker")
    parser.add_argument("spec")
    parser.add_argument("--layout", required=True)
    known, rest = parser.parse_known_args(argv)
    return ["run", "--spec", known.spec, "--layouts", known.layout, *rest]


if __name__ == "__main__":
    sys.exit(main(_args(sys.argv[1:])))
