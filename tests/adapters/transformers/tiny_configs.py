"""Tiny configs for the fitting tests: each config class's `fitting.tiny` (or why it has none), built once per
process whichever test module asks first, and config warnings silenced while a test runs."""

import logging

import pytest

from paracheck.adapters.transformers import fitting
from paracheck.adapters.transformers.fitting import Unfittable

_TINY: dict = {}


@pytest.fixture(autouse=True)
def quiet_configs():
    """Autouse in each module that imports it: configs warn about special token ids, which is not what is tested."""
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


def tiny_of(cls):
    """`fitting.tiny(cls)`, or the `Unfittable` it raised."""
    if cls not in _TINY:
        try:
            _TINY[cls] = fitting.tiny(cls)
        except Unfittable as exc:
            _TINY[cls] = exc
    return _TINY[cls]
