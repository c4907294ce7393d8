"""The library adapter against the installed diffusers: these fail when diffusers changes under it."""

import inspect

import pytest
import torch

from paracheck.adapters.diffusers import library
from paracheck.adapters.diffusers.layout import DiffusersLayout


def test_diffusers_still_divides_by_the_accelerator_count():
    """The shim `cpu_device_count` stands for: 0.42 divides by the accelerator count (0 on CPU); 0.41.0 by the
    device module's own (`torch.cpu.device_count()`, 1), which needs no shim."""
    import diffusers
    from diffusers.models.modeling_utils import ModelMixin
    from packaging.version import Version

    source = inspect.getsource(ModelMixin._resolve_parallel_config)
    older = Version(diffusers.__version__) < Version("0.42.0")
    assert ("rank % device_module.device_count()" if older else "rank % torch.accelerator.device_count()") in source


def test_diffusers_still_refuses_cpu_tensor_parallelism():
    import diffusers.hooks.tensor_parallel as tp

    assert "cpu" not in tp._SUPPORTED_TP_DEVICES
    assert "_SUPPORTED_TP_DEVICES" in inspect.getsource(tp.apply_tensor_parallel)


@pytest.mark.skipif(torch.accelerator.device_count() > 0, reason="the shim only acts without accelerators")
def test_device_count_shim_is_scoped():
    original = torch.accelerator.device_count
    with library.cpu_device_count():
        assert torch.accelerator.device_count() == 1
    assert torch.accelerator.device_count is original and original() == 0


def test_tensor_parallel_shim_is_scoped():
    import diffusers.hooks.tensor_parallel as tp

    before = tp._SUPPORTED_TP_DEVICES
    with library.cpu_tensor_parallel():
        assert "cpu" in tp._SUPPORTED_TP_DEVICES
    assert tp._SUPPORTED_TP_DEVICES == before


def test_shims_restore_on_error():
    import diffusers.hooks.tensor_parallel as tp

    before = tp._SUPPORTED_TP_DEVICES
    with pytest.raises(RuntimeError):
        with library.cpu_tensor_parallel():
            raise RuntimeError("boom")
    assert tp._SUPPORTED_TP_DEVICES == before


def test_private_names_the_adapter_reads_still_exist():
    from diffusers.hooks import context_parallel, tensor_parallel
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig, TensorParallelConfig

    assert callable(tensor_parallel.resolve_tp_shard_specs) and callable(context_parallel.apply_context_parallel)
    assert "_flattened_mesh" in inspect.getsource(ContextParallelConfig.setup)
    assert "_ulysses_mesh" in inspect.getsource(ContextParallelConfig.setup)
    assert "_mesh" in inspect.getsource(TensorParallelConfig.setup)
    assert "_parallel_config" in inspect.getsource(__import__("diffusers").ModelMixin.enable_parallelism)
    # The adapter builds ParallelConfig(tensor_parallel_config=..., context_parallel_config=...): both names stay.
    assert {"tensor_parallel_config", "context_parallel_config"} <= set(inspect.signature(ParallelConfig).parameters)


def test_every_private_the_adapter_names_exists_here():
    assert library.missing() == []
    assert library.unsupported() is None


def test_an_unservable_diffusers_exits_2_in_one_line(monkeypatch, capsys):
    """Outside the tested releases each private is looked up; one missing is one line naming the installed
    version, what is missing and the supported range, before any rank starts."""
    from paracheck.cli.main import main

    monkeypatch.setattr(library, "installed_version", lambda: "0.40.0")
    assert library.unsupported() is None  # an untested release that has every name is served
    monkeypatch.setattr(library, "PRIVATES", library.PRIVATES + (("diffusers.hooks.tensor_parallel",
                                                                   ("resolve_tp_shard_specs_v2",)),))
    assert main(["run", "--models", "flux", "--layouts", "u4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["paracheck: error: diffusers 0.40.0 lacks diffusers.hooks.tensor_parallel.resolve_tp_shard_specs_v2; "
                   f"paracheck supports {library.SUPPORTED}"]


def test_a_fixture_whose_class_is_missing_is_a_skip():
    from paracheck.domain.backends import get_backend
    from paracheck.domain.case import Case
    from paracheck.adapters.diffusers.plan import Sources, plan
    from tests.support import SPECS

    case = Case("gone", f"{SPECS}:class_not_in_this_diffusers", DiffusersLayout.parse("u4"), library="diffusers")
    p = plan(case, get_backend("gloo"), Sources())
    assert p.stop.status == "skip" and "cannot provide its model class" in p.stop.reason


def test_cp_hook_names_match_the_library():
    from diffusers.hooks import context_parallel

    source = inspect.getsource(context_parallel)
    assert library.CP_INPUT in source and library.CP_OUTPUT in source


def test_library_refuses_tp_and_cp_together_in_one_config():
    assert library.library_accepts(DiffusersLayout.parse("tp4")) and library.library_accepts(DiffusersLayout.parse("u4"))
    assert not library.library_accepts(DiffusersLayout.parse("tp2xu2"))


def test_findings_supply_warning_once_only_inside():
    import logging

    logger = logging.getLogger(library.CP_LOGGER)
    had = hasattr(logger, "warning_once")
    with library.Findings() as findings:
        logger.warning_once("split will not be applied")
    assert findings.messages == ["split will not be applied"]
    assert hasattr(logger, "warning_once") == had


def test_findings_see_a_warning_every_case_even_where_warning_once_caches():
    """transformers, once imported, gives every logger a `warning_once` that warns once per process."""
    import functools
    import logging

    logger = logging.getLogger(library.CP_LOGGER)
    cached = functools.lru_cache(None)(lambda self, *args: self.warning(*args))
    logging.Logger.warning_once, had = cached, logging.Logger.__dict__.get("warning_once")
    try:
        for _ in range(2):
            with library.Findings() as findings:
                logger.warning_once("split will not be applied")
            assert findings.messages == ["split will not be applied"]
        assert logging.Logger.warning_once is cached and "warning_once" not in logger.__dict__
    finally:
        if had is None:
            del logging.Logger.warning_once
        else:
            logging.Logger.warning_once = had


def test_entry_point_errors_name_the_entry_point_and_route():
    with pytest.raises(library.LibraryError, match="diffusers' enable_parallelism raised on route native: ValueError"):
        with library.entry_point("enable_parallelism", "native"):
            raise ValueError("'2' is not a submodule of 'ModuleList'")


def test_observed_attention_sees_the_config_and_restores_the_registry():
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry, dispatch_attention_fn

    before = dict(_AttentionBackendRegistry._backends)
    seen = []

    import contextlib

    @contextlib.contextmanager
    def observe(config):
        seen.append(config)
        yield

    q = torch.ones(1, 4, 2, 8)
    with pytest.raises(RuntimeError):
        with library.observed_attention(observe):
            dispatch_attention_fn(q, q, q, backend="native")
            raise RuntimeError("boom")
    assert seen == [None]
    assert _AttentionBackendRegistry._backends == before

