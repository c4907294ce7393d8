"""Backend topology rules and device counts: pure, no process group."""

import pytest
from hypothesis import given

from paracheck.domain.backends import BackendError, get_backend, resolve
from tests import strategies
from paracheck.domain.layout import Layout

layouts = strategies.layouts(8)


@given(layouts)
def test_gloo_takes_every_layout(layout):
    """Ring too: on CPU it runs with paracheck's attention op that returns the log-sum-exp."""
    assert get_backend("gloo").problems(layout) == []


@given(layouts)
def test_neuron_alltoall_group_sizes(layout):
    problems = " ".join(get_backend("neuron").problems(layout))
    u = layout.ulysses
    bad_size = u > 1 and u not in (4, 8, 16) and u % 32 != 0
    assert ("ulysses degree" in problems) == bad_size
    assert ("contiguous" in problems) == (u > 1 and layout.tp > 1 and layout.order == "tp-fastest")


def test_nccl_accepts_ring():
    assert get_backend("nccl").problems(Layout.parse("tp2xr2")) == []


def test_unknown_backend_names_the_choices():
    with pytest.raises(BackendError, match="--backend 'mpi'.*gloo, nccl, neuron"):
        get_backend("mpi")


def test_auto_is_gloo_without_accelerators(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("NEURON_RT_VISIBLE_CORES", raising=False)
    assert resolve("auto").name == "gloo"


def test_neuron_without_devices_is_a_usage_error(monkeypatch):
    monkeypatch.delenv("NEURON_RT_VISIBLE_CORES", raising=False)
    from paracheck.domain.backends import missing_devices

    if not __import__("glob").glob("/dev/neuron[0-9]*"):
        assert "no Neuron device here" in missing_devices(get_backend("neuron"), 8)
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-7")
    assert missing_devices(get_backend("neuron"), 8) is None
    assert "sees only 8 devices" in missing_devices(get_backend("neuron"), 16)
