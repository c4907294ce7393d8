"""Hypothesis strategies shared by the kit's tests."""

from hypothesis import strategies as st

from paracheck.adapters.diffusers.layout import DiffusersLayout
from paracheck.domain.layout import ORDERS


def layouts(max_degree: int = 6, max_ring: int | None = None):
    """Every layout with world > 1, degrees up to `max_degree` (ring up to `max_ring`), either order."""
    ring = st.integers(1, max_ring or max_degree)
    degree = st.integers(1, max_degree)
    return st.builds(DiffusersLayout, degree, ring, degree, st.sampled_from(ORDERS)).filter(lambda l: l.world > 1)
