"""structure.tp_shards' coverage rule, in process on a real one-rank gloo world: a TP layout that splits no
parameter fails (every check would pass exactly on it); one split parameter is enough (qwen3_vl's plan splits only
its vocabulary's embedding and head, exact by construction)."""

import torch

from paracheck.adapters.transformers.layout import TfLayout
from paracheck.adapters.transformers.structure import tp_coverage


def test_a_tp_layout_that_splits_nothing_fails_and_one_split_parameter_counts(tp_mesh_of_one):
    from torch.distributed.tensor import Shard, distribute_tensor

    whole = dict(torch.nn.Linear(4, 4).named_parameters())
    count, problems = tp_coverage(whole, TfLayout(tp=2))
    assert count == 0 and problems == [
        "tensor parallelism applied to nothing: the layout has tp=2, but none of the 2 parameters is sharded on the "
        "tp mesh (the TP plan's rules split no parameter)"]
    assert tp_coverage(whole, TfLayout(fsdp=2)) == (0, [])  # no tensor parallelism asked: nothing to split
    split = dict(whole, embed=torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), tp_mesh_of_one, [Shard(0)])))
    assert tp_coverage(split, TfLayout(tp=2)) == (1, [])


def test_each_mesh_dimensions_group_is_the_slice_of_transformers_row_major_dense_mesh():
    """structure.mesh's expected groups (`Layout.group`, no strides of its own) against an independent oracle: the
    world's ranks laid out row-major over (pp, dp_replicate, fsdp, cp, tp), sliced along one dimension."""
    from paracheck.adapters.transformers.structure import _group

    for world in (4, 8, 12):
        for layout in TfLayout.layouts_for(world):
            shape = [layout.pp, layout.dpr, layout.fsdp, layout.cp, layout.tp]
            ranks = torch.arange(layout.world).reshape(shape)
            for axis, dim in enumerate(("pp", "dp_replicate", "fsdp", "cp", "tp")):
                for rank in range(layout.world):
                    where = [int(i) for i in (ranks == rank).nonzero()[0]]
                    where[axis] = slice(None)
                    assert _group(layout, rank, dim) == ranks[tuple(where)].tolist(), (layout.name, rank, dim)
