"""What a rank keeps between cases and how it copies a model: `LastReference` (the reference read last,
for the next case) and `copy_of` (a model holding given weights, built without drawing random ones)."""

import pytest
import torch

from paracheck.adapters.diffusers import reference
from paracheck.adapters.diffusers.plan import Plan
from paracheck.adapters.diffusers.reference import LastReference, Reference
from paracheck.adapters.diffusers.weights import copy_of


class Tiny(torch.nn.Module):
    """Random and deterministic initializers, a persistent buffer, and a table built in __init__ that
    no state dict carries (as rotary tables are)."""

    def __init__(self, width: int = 4):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)
        self.register_buffer("steps", torch.zeros(1))
        self.register_buffer("table", torch.arange(width, dtype=torch.float32) / width, persistent=False)


class Broken(Tiny):
    def __init__(self):
        super().__init__()
        raise RuntimeError("the model's own error")


def _state(seed: int = 3) -> dict:
    torch.manual_seed(seed)
    model = Tiny()
    model.steps.fill_(7)
    return model.state_dict()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_of_is_what_constructing_and_loading_gives(dtype):
    state = {k: v.to(dtype) for k, v in _state().items()}
    expected = Tiny().eval().to("cpu", dtype)
    expected.load_state_dict(state)
    got = copy_of(Tiny, {}, state, torch.device("cpu"), dtype)
    assert not got.training
    assert got.state_dict().keys() == expected.state_dict().keys()
    assert all(torch.equal(got.state_dict()[k], v) for k, v in expected.state_dict().items())
    assert torch.equal(got.table, expected.table) and got.table.dtype == dtype
    # Its own tensors: the copy shares no storage with the state it was given.
    assert all(got.state_dict()[k].data_ptr() != v.data_ptr() for k, v in state.items())


@pytest.mark.filterwarnings("ignore:Casting complex values to real")
def test_copy_of_casts_what_to_would_cast():
    class Mixed(Tiny):
        def __init__(self):
            super().__init__()
            self.register_buffer("index", torch.arange(3), persistent=False)
            self.register_buffer("phase", torch.ones(2, dtype=torch.complex64), persistent=False)

    got = copy_of(Mixed, {}, _state(), torch.device("cpu"), torch.float32)
    expected = Mixed().to("cpu", torch.float32)  # casts the complex table too, with torch's warning
    assert got.index.dtype == torch.int64 and got.phase.dtype == expected.phase.dtype == torch.float32


def test_copy_of_draws_no_random_weights():
    state = _state()
    before = torch.random.get_rng_state()
    copy_of(Tiny, {}, state, torch.device("cpu"), torch.float32)
    assert torch.equal(torch.random.get_rng_state(), before)


def test_copy_of_needs_every_weight():
    state = _state()
    del state["linear.weight"]
    with pytest.raises(RuntimeError, match="linear.weight"):
        copy_of(Tiny, {}, state, torch.device("cpu"), torch.float32)


def test_initializers_are_restored_even_when_the_model_raises():
    original = torch.nn.init.kaiming_uniform_
    with pytest.raises(RuntimeError, match="own error"):
        copy_of(Broken, {}, _state(), torch.device("cpu"), torch.float32)
    assert torch.nn.init.kaiming_uniform_ is original
    torch.manual_seed(0)
    assert not torch.equal(torch.nn.Linear(4, 4).weight, torch.zeros(4, 4))


def _fake_loads(monkeypatch) -> list:
    """`reference.load` replaced: it records the keys read and fails for the key "broken"."""
    loads = []

    def load(p, refs_dir, device):
        loads.append(p.key)
        if p.key == "broken":
            raise RuntimeError("the model failed on one device")
        return Reference(torch.nn.Linear(2, 2), torch.zeros(1), torch.zeros(1))

    monkeypatch.setattr(reference, "load", load)
    return loads


def _get(last: LastReference, key: str) -> Reference:
    return last.get(Plan(case=None, key=key), "refs", torch.device("cpu"))


def test_the_next_case_with_the_same_key_shares_the_reference(monkeypatch):
    loads = _fake_loads(monkeypatch)
    last = LastReference()
    first = _get(last, "a")
    assert _get(last, "a") is first
    assert loads == ["a"]


def test_only_the_last_reference_is_kept(monkeypatch):
    loads = _fake_loads(monkeypatch)
    last = LastReference()
    first = _get(last, "a")
    _get(last, "b")
    assert _get(last, "a") is not first
    assert loads == ["a", "b", "a"]


def test_a_failed_read_keeps_nothing(monkeypatch):
    loads = _fake_loads(monkeypatch)
    last = LastReference()
    _get(last, "a")
    for _ in range(2):
        with pytest.raises(RuntimeError, match="one device"):
            _get(last, "broken")
    _get(last, "a")
    assert loads == ["a", "broken", "broken", "a"]
