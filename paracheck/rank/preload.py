"""What the fork server imports once, before it forks any rank: torch, the kit's rank side, and what each adapter
names (its library, its rank side, its fixtures' classes).

Importing starts no thread pool and no accelerator, so forking afterwards is safe; the ranks then pay nothing for
these imports.
"""

import torch  # noqa: F401
import torch.distributed  # noqa: F401
import torch.distributed.tensor  # noqa: F401

from paracheck.domain import registry
from paracheck.rank import skeleton, worker  # noqa: F401

for _adapter in registry.adapters().values():
    if _adapter.installed():
        _adapter.preload()

# Frozen before any fork: a rank's collector never walks (and so never copies out of the fork server) the pages of
# what was imported here, even if it collects before its own freeze.
import gc  # noqa: E402

gc.freeze()
