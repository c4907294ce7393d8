"""diffusers 0.42.1: LTX-Video's _cp_plan leaves a per-token timestep whole while it splits the sequence.

    python docs/upstream/ltx_per_token_timestep.py          # 2 ranks, gloo, CPU

LTX's image-to-video and condition pipelines pass the transformer a timestep of shape (batch, tokens), 0 on the
condition frame's tokens. `LTXVideoTransformer3DModel._cp_plan` splits `hidden_states` on the sequence, but not
`timestep` (Wan's plan splits a 2-D timestep), so every block's per-token modulation is the whole sequence's against
this rank's half of the tokens. Runs a tiny transformer from its config, Ulysses 2 and no encoder mask (LTX's mask
fails under Ulysses for another reason), with a 1-D timestep (works) and the pipelines' per-token one (raises).
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD, FRAMES, SIDE = 2, 2, 4
TOKENS = FRAMES * SIDE * SIDE


def model():
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(0)
    return LTXVideoTransformer3DModel(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=12,
                                      cross_attention_dim=24, num_layers=1, caption_channels=32).eval()


def inputs(per_token: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    timestep = torch.full((1, TOKENS), 500.0) if per_token else torch.tensor([500.0])
    if per_token:
        timestep[:, :SIDE * SIDE] = 0.0  # the condition frame's tokens, as LTXImageToVideoPipeline sets them
    return dict(hidden_states=torch.randn(1, TOKENS, 8, generator=g),
                encoder_hidden_states=torch.randn(1, 8, 32, generator=g), encoder_attention_mask=None,
                timestep=timestep, num_frames=FRAMES, height=SIDE, width=SIDE, return_dict=False)


def worker(rank, tmp):
    from diffusers import ContextParallelConfig

    torch.set_num_threads(1)
    # enable_parallelism picks `rank % torch.accelerator.device_count()`: a modulo by zero on a CPU-only machine.
    torch.accelerator.device_count = lambda: 1
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), WORLD), rank=rank,
                            world_size=WORLD)
    reference, parallel = model(), model()
    parallel.enable_parallelism(config=ContextParallelConfig(ulysses_degree=WORLD))
    for per_token in (False, True):
        with torch.no_grad():
            want = reference(**inputs(per_token))[0]
            try:
                got = parallel(**inputs(per_token))[0]
                line = f"max abs difference {float((got - want).abs().max()):.1e}"
            except RuntimeError as exc:
                line = f"RuntimeError: {exc}"
        if rank == 0:
            print(f"timestep {'(batch, tokens)' if per_token else '(batch,)'}: {line}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(tmp,), nprocs=WORLD)
