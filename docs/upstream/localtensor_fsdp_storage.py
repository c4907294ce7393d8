"""FSDP2 under torch's LocalTensorMode: a layer's reshard raises in `free_storage` (localtensor_fsdp_storage.md).

    python docs/upstream/localtensor_fsdp_storage.py
"""

import torch
import torch.distributed as dist
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
with LocalTensorMode(2):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    mesh = init_device_mesh("cpu", (2,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for attempt in (1, 2):  # the first unshard finds its storage allocated; the reshard after it frees it
        try:
            with torch.no_grad():
                model(torch.ones(1, 4))
            print(f"forward {attempt} ran")
        except RuntimeError as exc:
            print(f"forward {attempt} raised RuntimeError: {exc}")
dist.destroy_process_group()
