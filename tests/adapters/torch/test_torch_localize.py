"""The torch adapter's localization in process: the placements a parallelize's TP styles declare, read back from the
hooks torch installs (on a one-rank gloo world), a declared dim as the only reading of a split, and a difference
planted in one module of the llama example found there by the adapter's own `after_checks`. The real multi-rank
runs are in tests/adapters/torch/test_torch_adapter.py."""

import importlib.util
import os
import types

import pytest
import torch
from hypothesis import given, strategies as st

from paracheck.adapters.torch import localize as torch_localize
from paracheck.adapters.torch.controls import CONTROLS, PLANTED, planted_in
from paracheck.adapters.torch.layout import TorchLayout
from paracheck.checks import localize
from paracheck.domain.records import CheckId, CheckResult, Status
from tests.support import ROOT


def _llama():
    spec = importlib.util.spec_from_file_location("paracheck_test_llama", os.path.join(ROOT, "examples", "llama_tp_fsdp.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def mesh(tp_mesh_of_one):
    return tp_mesh_of_one


def _parallel_llama(llama, mesh):
    """The example's plan (sequence parallel) applied on a one-rank "tp" mesh: the styles' hooks, as on any."""
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    model = llama.build()
    parallel = llama.Decoder()
    parallel.load_state_dict(model.state_dict())
    parallelize_module(parallel, mesh, llama.model_plan(True))
    for block in parallel.layers.values():
        parallelize_module(block, mesh, llama.block_plan(True))
    return model, parallel


def test_the_styles_that_hand_on_local_tensors_declare_their_placements(mesh):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import PrepareModuleOutput, parallelize_module

    _, model = _parallel_llama(_llama(), mesh)
    declared = torch_localize.placements(model)
    assert declared[("layers.0.attention.wq", "out")] == [{"tp": -1}]  # ColwiseParallel: Shard(-1), local
    assert declared[("layers.1.feed_forward.w2", "out")] == [{"tp": 1}]  # RowwiseParallel onto the sequence
    assert declared[("tok_embeddings", "out")] == [{"tp": 1}]
    assert declared[("output", "out")] == [{"tp": None}]  # gathered whole (Replicate)
    # SequenceParallel and PrepareModuleInput hand on DTensors (taken whole): nothing to declare.
    assert ("layers.0.attention_norm", "out") not in declared and ("layers.0.attention", "in") not in declared
    assert not any(side == "in" for _, side in declared)
    assert torch_localize.preferred(declared, "tp")[0] == -1  # the most declared dim is read first

    head = torch.nn.Sequential(torch.nn.Linear(4, 4))
    parallelize_module(head, mesh, {"0": PrepareModuleOutput(output_layouts=Shard(0),
                                                             desired_output_layouts=Shard(1), use_local_output=True)})
    assert torch_localize.placements(head) == {("0", "out"): [{"tp": 1}]}  # the layout it hands on


dims = st.integers(0, 2)


@given(dims, dims, st.sampled_from([2, 3]))
def test_a_declared_dim_is_the_only_reading_of_its_group(tp_dim, cp_dim, degree):
    """Two groups splitting two dims of a square tensor can be read either way round from the shapes alone; the
    plan's declaration decides, and a declaration the shapes cannot meet says so."""
    if tp_dim == cp_dim:
        return
    whole = (degree * 2,) * 3
    local = tuple(n // degree if d in (tp_dim, cp_dim) else n for d, n in enumerate(whole))
    shapes = dict.fromkeys(range(degree * degree), local)
    tp = [tuple(range(i * degree, (i + 1) * degree)) for i in range(degree)]
    cp = [tuple(range(i, degree * degree, degree)) for i in range(degree)]
    groups = [("tp", tp, (cp_dim,)), ("cp", cp, (tp_dim,))]  # the shapes' first reading is the wrong way round
    assert localize.sharding(whole, shapes, groups) == (cp_dim, tp_dim)
    assert localize.sharding(whole, shapes, groups, {"tp": tp_dim}) == (tp_dim, cp_dim)
    unmet = next(d for d in range(3) if d not in (tp_dim, cp_dim))
    why = localize.sharding(whole, shapes, groups, {"tp": unmet})
    assert isinstance(why, str) and f"the plan declares tp split on dim {unmet}" in why


def test_the_shard_swap_is_judged_by_the_module_its_planter_names():
    swap = CONTROLS["torch-shard-swap"]
    assert swap.plants_in == PLANTED and planted_in("torch-shard-swap", "layers.0.attention.wq.weight") == \
        "layers.0.attention.wq"
    assert swap.planted_at("layers.0.attention.wq", "layers.0.attention.wq")
    assert not swap.planted_at("layers.0.attention", "layers.0.attention.wq")
    assert not swap.planted_at("layers.0.attention.wq")  # no place reported: nothing matches
    assert planted_in("torch-grad-sum", "FSDPDecoder") is None and CONTROLS["torch-grad-sum"].planted_at("<root>")


def test_a_difference_planted_in_one_module_is_found_there_by_the_adapter(mesh):
    """`after_checks` itself on a failing forward check: both models rerun with hooks, every module before the
    planted one agrees (its local shards read back by the declared placements), the planted one is the origin."""
    llama = _llama()
    ref, model = _parallel_llama(llama, mesh)
    with torch.no_grad():
        model.layers["1"].feed_forward.w2.weight.to_local().mul_(1.01)
    body = types.SimpleNamespace(ref_model=ref, model=model, mesh=mesh, layout=TorchLayout(tp=1),
                                 mine=llama.inputs(None)["tokens"], atol=1e-5, rtol=1e-5)
    check = CheckResult(CheckId.FORWARD, Status.FAIL, "output differs")
    torch_localize.after_checks(body, [check])
    found = check.data["localization"]["forward"]
    assert found["origin"] == "layers.1.feed_forward.w2" and found["pass"] == "training", found
    assert found["not_compared"] == []
    order = [m["module"] for m in found["modules"]]
    before = order[:order.index("layers.1.feed_forward.w2")]
    assert "layers.1.feed_forward.w1" in before
    assert all(m["within"] for m in found["modules"] if m["module"] in before)


def test_a_module_on_one_side_only_is_listed_not_compared(mesh):
    """A parallelize that wraps a module (the final norm inside a Sequential): the wrapper's inner module exists on
    the parallel side only, and is listed with why; the wrapper itself, under the reference's name, is compared."""
    llama = _llama()
    ref, model = _parallel_llama(llama, mesh)
    model.norm = torch.nn.Sequential(model.norm)
    with torch.no_grad():
        model.output.weight.to_local().mul_(1.01)
    body = types.SimpleNamespace(ref_model=ref, model=model, mesh=mesh, layout=TorchLayout(tp=1),
                                 mine=llama.inputs(None)["tokens"], atol=1e-5, rtol=1e-5)
    check = CheckResult(CheckId.INFERENCE, Status.FAIL, "no_grad output differs")
    torch_localize.after_checks(body, [check])
    found = check.data["localization"]["forward"]
    assert found["not_compared"] == [{"module": "norm.0", "why": "on the parallel model only"}]
    assert found["origin"] == "output" and found["pass"] == "no_grad"
    assert next(m for m in found["modules"] if m["module"] == "norm")["within"]
