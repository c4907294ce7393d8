"""torchrun entry point, runnable by path:

    python -m torch.distributed.run --nproc_per_node=4 workers/spec_worker.py MODULE:FUNCTION --layout tp2xu2

Runs one case of a user's factory (returning `(model_class, init_dict, inputs)`) on every rank and
prints one summary line per rank; exits 0 when every check passed (or the case was skipped), 1 otherwise.
"""

import sys

from paracheck.worker import torchrun_main

if __name__ == "__main__":
    sys.exit(torchrun_main())
