"""torch 2.13 LocalTensorMode: dist.all_gather (the list form) over a subgroup hands every rank the last subgroup's tensors."""
import torch
import torch.distributed as dist
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
group = mesh.get_group("b")  # this process's (rank 0's) group [0, 1]; the other is [2, 3]
x = LocalTensor({r: torch.tensor([float(r)]) for r in range(4)})
with LocalTensorMode(4):
    out = [torch.empty_like(x) for _ in range(2)]
    dist.all_gather(out, x, group=group)
    tensor = LocalTensor({r: torch.empty(2) for r in range(4)})
    dist.all_gather_into_tensor(tensor, x, group=group)
for r in range(4):
    print(f"rank {r}: all_gather {[o._local_tensors[r].item() for o in out]}, "
          f"all_gather_into_tensor {tensor._local_tensors[r].tolist()}")
print("expected: ranks 0, 1 -> [0.0, 1.0]; ranks 2, 3 -> [2.0, 3.0]")
dist.destroy_process_group()
