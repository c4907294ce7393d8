"""The `neuron-tp` route: diffusers' Neuron tensor-parallel path (`_apply_tp_neuron`) on CPU ranks, with only the
Neuron device stood in for. In process: the stand-in is scoped and the library's own dispatch takes the path (a
one-rank gloo world); launched: flux through the path passes the TP checks, and the shard-index control is caught.
"""

import pytest
import torch

from paracheck.adapters.diffusers import library
from paracheck.adapters.diffusers.fitting import Unfittable
from paracheck.adapters.diffusers.routes import resolve_route
from paracheck.adapters.diffusers.layout import DiffusersLayout
from paracheck.domain.records import Route
from tests.support import run_paracheck


def test_the_stand_in_is_scoped_and_restored_on_error():
    import diffusers.hooks.tensor_parallel as tp
    import diffusers.hooks.tensor_parallel_neuron as neuron

    apply, apply_neuron = tp.apply_tensor_parallel, neuron._apply_tp_neuron
    with pytest.raises(RuntimeError, match="boom"):
        with library.neuron_tensor_parallel():
            assert tp.apply_tensor_parallel is not apply and neuron._apply_tp_neuron is not apply_neuron
            assert not hasattr(torch, "neuron")  # only while _apply_tp_neuron runs
            raise RuntimeError("boom")
    assert tp.apply_tensor_parallel is apply and neuron._apply_tp_neuron is apply_neuron
    assert not hasattr(torch, "neuron")


def test_a_block_that_applies_no_tp_through_the_library_raises():
    """TP applied some other way (or not at all) inside the block would pass for the Neuron path: it says so."""
    with pytest.raises(library.NeuronPathNotReached, match="ran 0 time"):
        with library.neuron_tensor_parallel():
            pass


def test_torch_neuron_answers_the_cpu_inside_only():
    with library.torch_neuron_on_cpu():
        assert torch.neuron.current_device() == torch.device("cpu")
    assert not hasattr(torch, "neuron")


def test_the_route_takes_tp_layouts_on_cpu_or_neuron_only():
    assert resolve_route(Route.NEURON_TP, DiffusersLayout.parse("tp4"), "cpu") == Route.NEURON_TP
    assert resolve_route(Route.NEURON_TP, DiffusersLayout.parse("tp2xu2"), "neuron") == Route.NEURON_TP
    with pytest.raises(Unfittable, match="no tensor parallelism"):
        resolve_route(Route.NEURON_TP, DiffusersLayout.parse("u4"), "cpu")
    with pytest.raises(Unfittable, match="not on cuda"):
        resolve_route(Route.NEURON_TP, DiffusersLayout.parse("tp4"), "cuda")


def test_diffusers_own_dispatch_takes_the_neuron_path_on_a_cpu_mesh(tp_mesh_of_one):
    """`apply_tensor_parallel` itself picks `_apply_tp_neuron`, which pre-shards every planned weight into a DTensor
    on the real CPU mesh; the mesh keeps its device type."""
    import diffusers.hooks.tensor_parallel_neuron as neuron
    from diffusers.models._modeling_parallel import TensorParallelConfig
    from torch.distributed.tensor import DTensor

    from paracheck.fixtures import flux

    model_class, init_dict, _ = flux()
    model, config, seen = model_class(**init_dict), TensorParallelConfig(), []
    config._mesh = tp_mesh_of_one
    with library.neuron_tensor_parallel():
        original = neuron._apply_tp_neuron
        neuron._apply_tp_neuron = lambda m, mesh, *rest: (seen.append(mesh), original(m, mesh, *rest))
        try:
            library.apply_tensor_parallel(model, config)
        finally:
            neuron._apply_tp_neuron = original
    planned = library.tp_shard_specs(model, 1)
    params = dict(model.named_parameters())
    assert planned and all(isinstance(params[name], DTensor) for name in planned)
    assert seen and config._mesh is tp_mesh_of_one and tp_mesh_of_one.device_type == "cpu"
    assert not hasattr(torch, "neuron")


def test_a_tp_application_that_misses_the_neuron_path_raises(tp_mesh_of_one, monkeypatch):
    """Were the dispatch to read the mesh as the CPU again (a diffusers that decides otherwise), the default path
    would run and pass for the Neuron one: the block says so instead."""
    from diffusers.models._modeling_parallel import TensorParallelConfig

    from paracheck.fixtures import flux

    monkeypatch.setattr(library._ReadsAsNeuron, "device_type", "cpu")
    model_class, init_dict, _ = flux()
    config = TensorParallelConfig()
    config._mesh = tp_mesh_of_one
    with pytest.raises(library.NeuronPathNotReached, match="_apply_tp_neuron 0"):
        with library.neuron_tensor_parallel(), library.cpu_tensor_parallel():
            library.apply_tensor_parallel(model_class(**init_dict), config)


@pytest.mark.slow
def test_flux_tp4_through_the_neuron_path_passes_and_reports_the_stand_in(tmp_path):
    run = run_paracheck(["--models", "flux", "--layouts", "tp4", "--nproc", "4", "--variants", "base",
                         "--route", "neuron-tp", "--quiet"], tmp_path)
    assert run.code == 0, run.out
    case = run.case("flux", "tp4")
    checks = {c["id"]: c for c in case["checks"]}
    assert case["route"] == "neuron-tp" and case["status"] == "pass", case
    for check in ("structure.mesh", "structure.tp_shards", "parity.forward", "parity.inference", "parity.grads"):
        assert checks[check]["status"] == "pass", checks[check]
    assert checks["parity.forward"]["max_abs"] < 1e-6
    stood = checks["structure.tp_shards"]["data"]["per_rank"]["0"]["stood_in"]
    assert "_apply_tp_neuron" in stood["library"] and "stand-in structure.tp_shards" in run.out


@pytest.mark.slow
def test_the_shard_index_control_is_caught_on_the_neuron_path(tmp_path):
    run = run_paracheck(["--models", "flux", "--layouts", "tp2xu2", "--nproc", "4", "--variants", "base",
                         "--route", "neuron-tp", "--controls", "--only-control", "global-rank-shard-index",
                         "--no-grads", "--quiet"], tmp_path, switches={"PARACHECK_LOCALIZE": "0"})
    assert run.code == 0, run.out
    case = run.case("flux", "tp2xu2", "global-rank-shard-index")
    checks = {c["id"]: c["status"] for c in case["checks"]}
    assert case["status"] == "detected", case
    assert checks["structure.tp_shards"] == checks["parity.forward"] == "fail"
    assert checks["structure.mesh"] == checks["structure.cp_hooks"] == "pass"
