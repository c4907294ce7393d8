"""diffusers 0.42.1: Flux's _cp_plan splits the image tokens but not the ControlNet residuals added to them.

    python docs/upstream/flux_controlnet_residuals_cp.py    # 2 ranks, gloo, CPU

`FluxControlNetPipeline` runs its ControlNet on the whole sequence and passes the transformer one residual per block
(`controlnet_block_samples`, `controlnet_single_block_samples`: lists of (batch, image tokens, dim)). The
transformer's `_cp_plan` splits `hidden_states` on the sequence and nothing in those lists, so each block adds a
whole-sequence residual to this rank's share of the tokens. Runs a tiny transformer from its config under Ulysses 2:
without residuals (exact) and with them (raises).
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD, IMAGE, TEXT, DIM = 2, 16, 8, 32


def model():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                  pooled_projection_dim=32, axes_dims_rope=(4, 4, 8)).eval()


def inputs(control: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    out = dict(hidden_states=torch.randn(1, IMAGE, 4, generator=g),
               encoder_hidden_states=torch.randn(1, TEXT, 32, generator=g),
               pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.5]),
               img_ids=torch.zeros(IMAGE, 3), txt_ids=torch.zeros(TEXT, 3), return_dict=False)
    if control:  # what FluxControlNetModel returns: one (batch, image tokens, inner dim) residual per block
        out.update(controlnet_block_samples=[torch.randn(1, IMAGE, DIM, generator=g)],
                   controlnet_single_block_samples=[torch.randn(1, IMAGE, DIM, generator=g)])
    return out


def worker(rank, tmp):
    from diffusers import ContextParallelConfig

    torch.set_num_threads(1)
    # enable_parallelism picks `rank % torch.accelerator.device_count()`: a modulo by zero on a CPU-only machine.
    torch.accelerator.device_count = lambda: 1
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), WORLD), rank=rank,
                            world_size=WORLD)
    reference, parallel = model(), model()
    parallel.enable_parallelism(config=ContextParallelConfig(ulysses_degree=WORLD))
    for control in (False, True):
        with torch.no_grad():
            want = reference(**inputs(control))[0]
            try:
                got = parallel(**inputs(control))[0]
                line = f"max abs difference {float((got - want).abs().max()):.1e}"
            except RuntimeError as exc:
                line = f"RuntimeError: {exc}"
        if rank == 0:
            print(f"{'with' if control else 'without'} ControlNet residuals: {line}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(tmp,), nprocs=WORLD)
