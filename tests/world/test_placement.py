"""Where a rank's tensors live: one rule (`reference.place` for inputs, `world.site.local_device` for the rank),
the same path on gloo as on devices; results are compared on the CPU in float64 (`checks.compare`)."""

import torch

from paracheck.domain.backends import get_backend
from paracheck.adapters.diffusers.reference import place


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return []


def test_place_moves_every_tensor_and_casts_only_floating_ones():
    inputs = {"x": torch.ones(2, 3), "ids": torch.arange(3), "shapes": [(1, 4, 4)], "nested": {"t": torch.zeros(1)},
              "n": 3}
    # meta is a device other than the one the inputs were made on, so a tensor left behind shows.
    placed = place(inputs, torch.device("meta"), torch.bfloat16)
    assert len(_tensors(placed)) == 3 and all(t.device.type == "meta" for t in _tensors(placed))
    assert placed["x"].dtype == torch.bfloat16 and placed["nested"]["t"].dtype == torch.bfloat16
    assert placed["ids"].dtype == torch.int64 and placed["shapes"] == [(1, 4, 4)] and placed["n"] == 3
    kept = place(inputs, torch.device("cpu"))
    assert kept["x"].dtype == torch.float32 and all(t.device.type == "cpu" for t in _tensors(kept))


def test_each_backend_puts_a_rank_on_its_own_device(monkeypatch):
    from paracheck.world.site import local_device

    assert get_backend("gloo").device_for(3) == "cpu"
    assert get_backend("nccl").device_for(3) == "cuda:3"
    assert get_backend("neuron").device_for(5) == "neuron:5"
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert local_device(get_backend("gloo")) == torch.device("cpu")
    assert local_device(get_backend("nccl")) == torch.device("cuda", 3)


def test_comparisons_happen_on_the_cpu_in_float64():
    from paracheck.checks.compare import compare
    from paracheck.domain.records import CheckId, Status

    a = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    assert compare(CheckId.FORWARD, a, a.float(), 1e-5, 1e-5).status == Status.PASS
    # A difference float32 cannot hold (1 + 1e-12 rounds to 1 there) is measured: the comparison is float64.
    one = torch.tensor([1.0], dtype=torch.float64)
    result = compare(CheckId.FORWARD, one + 1e-12, one, 1e-5, 1e-5)
    assert result.status == Status.PASS and 0 < result.max_abs < 1e-11
