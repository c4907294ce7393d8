"""Where a rank's tensors live: one rule (`reference.place` for inputs, `worker.local_device` for the rank),
the same path on gloo as on devices; results are compared on the CPU in float64 (`checks.compare`)."""

import torch

from paracheck.backends import get_backend
from paracheck.reference import place


def test_place_moves_every_tensor_and_casts_only_floating_ones():
    inputs = {"x": torch.ones(2, 3), "ids": torch.arange(3), "shapes": [(1, 4, 4)], "nested": {"t": torch.zeros(1)},
              "n": 3}
    placed = place(inputs, torch.device("cpu"), torch.bfloat16)
    assert placed["x"].dtype == torch.bfloat16 and placed["nested"]["t"].dtype == torch.bfloat16
    assert placed["ids"].dtype == torch.int64 and placed["shapes"] == [(1, 4, 4)] and placed["n"] == 3
    assert place(inputs, torch.device("cpu"))["x"].dtype == torch.float32


def test_each_backend_puts_a_rank_on_its_own_device():
    assert get_backend("gloo").device_for(3) == "cpu"
    assert get_backend("nccl").device_for(3) == "cuda:3"
    assert get_backend("neuron").device_for(5) == "neuron:5"


def test_comparisons_happen_on_the_cpu_in_float64():
    from paracheck.checks import compare
    from paracheck.records import CheckId, Status

    a = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    assert compare(CheckId.FORWARD, a, a.float(), 1e-5, 1e-5).status == Status.PASS
