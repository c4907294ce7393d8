"""What the fork server imports once, before it forks any rank: torch, diffusers, the kit, the fixtures.

Importing starts no thread pool and no accelerator, so forking afterwards is safe; the ranks then pay
nothing for these imports. diffusers loads its model modules lazily, so the fixture classes are touched.
"""

import diffusers
import torch  # noqa: F401
import torch.distributed  # noqa: F401
import torch.distributed.tensor  # noqa: F401

from paracheck.adapters.diffusers import checks
from paracheck.adapters.diffusers import controls
from paracheck.adapters.diffusers import plan, reference  # noqa: F401
from paracheck.adapters.diffusers import routes
from paracheck.rank import worker
from paracheck.adapters.diffusers.fixtures_index import FIXTURE_CLASSES

for _name in FIXTURE_CLASSES:
    getattr(diffusers, _name, None)
import diffusers.hooks.context_parallel  # noqa: E402,F401
import diffusers.hooks.tensor_parallel  # noqa: E402,F401

try:  # the transformers adapter's modules, where transformers is installed (the fixtures' classes load lazily)
    import transformers  # noqa: F401
    import transformers.distributed  # noqa: F401

    from paracheck.adapters.transformers import rank as _transformers_rank
except ImportError:
    pass
