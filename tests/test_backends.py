"""Backend topology rules (pure) and the gloo shims (tested against the installed diffusers)."""

import inspect

import pytest
import torch
from hypothesis import given, strategies as st

from paracheck.backends import BackendError, cpu_device_count, cpu_tensor_parallel, get_backend, resolve
from paracheck.layout import Layout

layouts = st.builds(Layout, st.integers(1, 8), st.integers(1, 8), st.integers(1, 8),
                    st.sampled_from(["cp-fastest", "tp-fastest"])).filter(lambda l: l.world > 1)


@given(layouts)
def test_gloo_refuses_exactly_the_ring_layouts(layout):
    assert bool(get_backend("gloo").problems(layout)) == (layout.ring > 1)


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


# -- the shims: these fail if diffusers changes under them --------------------------------------


def test_diffusers_still_divides_by_the_accelerator_count():
    from diffusers.models.modeling_utils import ModelMixin

    source = inspect.getsource(ModelMixin._resolve_parallel_config)
    assert "rank % torch.accelerator.device_count()" in source


def test_diffusers_still_refuses_cpu_tensor_parallelism():
    import diffusers.hooks.tensor_parallel as tp

    assert "cpu" not in tp._SUPPORTED_TP_DEVICES
    assert "_SUPPORTED_TP_DEVICES" in inspect.getsource(tp.apply_tensor_parallel)


@pytest.mark.skipif(torch.accelerator.device_count() > 0, reason="the shim only acts without accelerators")
def test_device_count_shim_is_scoped():
    original = torch.accelerator.device_count
    with cpu_device_count():
        assert torch.accelerator.device_count() == 1
    assert torch.accelerator.device_count is original and original() == 0


def test_tensor_parallel_shim_is_scoped():
    import diffusers.hooks.tensor_parallel as tp

    before = tp._SUPPORTED_TP_DEVICES
    with cpu_tensor_parallel():
        assert "cpu" in tp._SUPPORTED_TP_DEVICES
    assert tp._SUPPORTED_TP_DEVICES == before


def test_shims_restore_on_error():
    import diffusers.hooks.tensor_parallel as tp

    before = tp._SUPPORTED_TP_DEVICES
    with pytest.raises(RuntimeError):
        with cpu_tensor_parallel():
            raise RuntimeError("boom")
    assert tp._SUPPORTED_TP_DEVICES == before
