"""Many tensors through one collective: `flatten` / `unflatten` and the bucketed gather and reduce that
`parity.grads` uses, with the collective faked in-process (every rank's buffer is computed here)."""

import torch
from hypothesis import given, strategies as st

from paracheck.checks.buckets import dtype_buckets, flatten, gather_each, reduce_each, unflatten

DTYPES = (torch.float32, torch.bfloat16, torch.float64)


@st.composite
def named_tensors(draw, max_size: int = 6):
    """name -> tensor: scalars, empty and odd shapes, mixed dtypes, in a drawn insertion order."""
    count = draw(st.integers(1, max_size))
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(count):
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        dtype = draw(st.sampled_from(DTYPES))
        tensors[f"p{i}"] = torch.randn(shape, generator=generator).to(dtype)
    return tensors


@given(named_tensors())
def test_unflatten_inverts_flatten(tensors):
    for names in dtype_buckets(tensors):
        pieces = [tensors[n] for n in names]
        flat = flatten(pieces)
        assert flat.dim() == 1 and flat.numel() == sum(p.numel() for p in pieces)
        back = unflatten(flat, [p.shape for p in pieces])
        assert all(b.shape == p.shape and b.dtype == p.dtype and torch.equal(b, p) for b, p in zip(back, pieces))


@given(named_tensors())
def test_buckets_hold_one_dtype_each_in_a_fixed_order(tensors):
    buckets = dtype_buckets(tensors)
    assert sorted(n for names in buckets for n in names) == sorted(tensors)
    assert all(len({tensors[n].dtype for n in names}) == 1 for names in buckets)
    # Every rank must issue the buckets' collectives in the same order, however it met the dtypes.
    reordered = dict(reversed(list(tensors.items())))
    assert [str(tensors[b[0]].dtype) for b in buckets] == [str(reordered[b[0]].dtype) for b in dtype_buckets(reordered)]


@given(named_tensors(), st.integers(1, 4))
def test_gather_each_returns_every_ranks_copy(tensors, world):
    calls = []

    def fake_all_gather(flat):
        calls.append(flat.dtype)
        return [flat * (rank + 1) for rank in range(world)]  # rank r holds (r + 1) x this rank's tensors

    gathered = gather_each(tensors, fake_all_gather)
    assert len(calls) == len(dtype_buckets(tensors))  # one collective per dtype, not one per tensor
    for name, tensor in tensors.items():
        assert len(gathered[name]) == world
        assert all(torch.equal(piece, tensor * (rank + 1)) for rank, piece in enumerate(gathered[name]))


@given(named_tensors())
def test_reduce_each_reduces_every_tensor_and_leaves_inputs_alone(tensors):
    before = {n: t.clone() for n, t in tensors.items()}
    calls = []

    def fake_all_reduce(flat):
        calls.append(flat.dtype)
        flat.mul_(3)  # a sum over three ranks holding the same values

    reduced = reduce_each(tensors, fake_all_reduce)
    assert len(calls) == len(dtype_buckets(tensors))
    assert all(torch.equal(reduced[n], before[n] * 3) for n in tensors)
    assert all(torch.equal(tensors[n], before[n]) for n in tensors)


def test_empty_input_issues_no_collective():
    assert gather_each({}, lambda flat: 1 / 0) == {}
    assert reduce_each({}, lambda flat: 1 / 0) == {}
