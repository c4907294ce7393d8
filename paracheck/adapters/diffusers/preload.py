"""What the diffusers adapter has the fork server import once: diffusers, its hooks, the fixtures' classes (diffusers
loads model modules lazily, so each is touched), and the adapter's rank side."""

import diffusers

from paracheck.adapters.diffusers import body, checks, controls, plan, reference, routes  # noqa: F401
from paracheck.adapters.diffusers.fixtures_index import FIXTURE_CLASSES

for _name in FIXTURE_CLASSES:
    getattr(diffusers, _name, None)
import diffusers.hooks.context_parallel  # noqa: E402,F401
import diffusers.hooks.tensor_parallel  # noqa: E402,F401
