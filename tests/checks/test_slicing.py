"""TP shard slicing and reassembly: `assemble` inverts `local_slice` for every block layout."""

from dataclasses import dataclass

import torch
from hypothesis import given, strategies as st

from paracheck.checks.shards import assemble, local_slice


@dataclass
class Spec:
    dim: int | None
    block_sizes: list[int]


@st.composite
def sharded(draw):
    tp = draw(st.sampled_from([1, 2, 4]))
    blocks = draw(st.lists(st.integers(1, 3).map(lambda k: k * tp * 2), min_size=1, max_size=3))
    dim = draw(st.sampled_from([0, 1]))
    other = draw(st.integers(1, 4))
    shape = [sum(blocks), other] if dim == 0 else [other, sum(blocks)]
    return torch.randn(shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 99)))), Spec(dim, blocks), tp


@given(sharded())
def test_assemble_inverts_local_slice(data):
    full, spec, tp = data
    pieces = [local_slice(full, spec, i, tp) for i in range(tp)]
    assert all(p.shape[spec.dim] == full.shape[spec.dim] // tp for p in pieces)
    assert torch.equal(assemble(pieces, spec), full)


@given(sharded())
def test_shards_are_disjoint_per_block(data):
    full, spec, tp = data
    if tp == 1:
        return
    index = torch.arange(full.shape[spec.dim], dtype=torch.float64)
    view = index.reshape(-1, 1) if spec.dim == 0 else index.reshape(1, -1)
    taken = torch.cat([local_slice(view, spec, i, tp).flatten() for i in range(tp)])
    assert sorted(taken.tolist()) == index.tolist()


def test_packed_blocks_are_not_a_plain_split():
    """Why `assemble` exists: a packed (q, k, v)-style parameter is not torch.chunk along dim."""
    full, spec = torch.arange(8.0).reshape(8, 1), Spec(0, [4, 4])
    assert local_slice(full, spec, 0, 2).flatten().tolist() == [0, 1, 4, 5]
    assert not torch.equal(local_slice(full, spec, 0, 2), full.chunk(2)[0])
