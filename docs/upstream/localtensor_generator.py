"""torch 2.13 LocalTensorMode: an op drawing from an explicit torch.Generator hands rank r the (r+1)-th draw."""
import torch
from torch.distributed._local_tensor import LocalTensorMode

with LocalTensorMode(4):
    x = torch.randn(2, generator=torch.Generator().manual_seed(0))
for r in range(4):
    print(f"rank {r}: {[round(v, 4) for v in x._local_tensors[r].tolist()]}")
print(f"expected, every rank: {[round(v, 4) for v in torch.randn(2, generator=torch.Generator().manual_seed(0)).tolist()]}")
