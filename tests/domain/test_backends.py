"""Backend topology rules and device counts: pure, no process group."""

import pytest

from paracheck.domain.backends import BackendError, get_backend, resolve


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
