"""diffusers 0.42.1: LTX's attention processors expand the encoder mask to the global head count under Ulysses.

    python docs/upstream/ltx_mask_global_heads.py           # 2 ranks, gloo, CPU

`LTXVideoAttnProcessor` (and LTX-2's) views the prepared encoder mask as `(batch, attn.heads, -1, S)`: one bias per
head of the whole model. Under Ulysses each rank attends with `heads / ulysses` heads after the all-to-all, so the
mask broadcasts them back up to the full count and the output's reshape raises. Runs a tiny LTX-Video and a tiny
LTX-2 transformer from their configs, Ulysses 2, once without an encoder mask (exact) and once with a mask of ones
(the values play no part, only the mask's shape). LTX-2 runs with its modalities isolated: its audio-video
cross-attention fails under CP for another reason (docs/upstream/ltx2_cross_attn_rope.md).
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD, SIDE, TEXT = 2, 4, 8


def ltx():
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(0)
    model = LTXVideoTransformer3DModel(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=12,
                                       cross_attention_dim=24, num_layers=1, caption_channels=32).eval()
    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, SIDE * SIDE, 8, generator=g),
                  encoder_hidden_states=torch.randn(1, TEXT, 32, generator=g), timestep=torch.tensor([500.0]),
                  num_frames=1, height=SIDE, width=SIDE, return_dict=False)
    return model, inputs


def ltx2():
    from diffusers import LTX2VideoTransformer3DModel

    torch.manual_seed(0)
    model = LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
        audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2, audio_attention_head_dim=4,
        audio_cross_attention_dim=8, num_layers=1, caption_channels=16, rope_double_precision=False).eval()
    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, SIDE * SIDE, 4, generator=g),
                  audio_hidden_states=torch.randn(1, 4, 4, generator=g),
                  encoder_hidden_states=torch.randn(1, TEXT, 16, generator=g),
                  audio_encoder_hidden_states=torch.randn(1, 4, 16, generator=g), timestep=torch.tensor([500.0]),
                  num_frames=1, height=SIDE, width=SIDE, audio_num_frames=4, fps=25.0, isolate_modalities=True,
                  return_dict=False)
    return model, inputs


def compare(rank, build):
    from diffusers import ContextParallelConfig

    reference, inputs = build()
    parallel, _ = build()
    parallel.enable_parallelism(config=ContextParallelConfig(ulysses_degree=WORLD))
    for mask in (None, torch.ones(1, TEXT)):
        with torch.no_grad():
            want = reference(**inputs, encoder_attention_mask=mask)[0]
            try:
                got = parallel(**inputs, encoder_attention_mask=mask)[0]
                line = f"max abs difference {float((got - want).abs().max()):.1e}"
            except RuntimeError as exc:
                line = f"RuntimeError: {exc}"
        if rank == 0:
            print(f"{type(reference).__name__}, encoder mask {'of ones' if mask is not None else 'None'}: {line}")


def worker(rank, tmp):
    torch.set_num_threads(1)
    # enable_parallelism picks `rank % torch.accelerator.device_count()`: a modulo by zero on a CPU-only machine.
    torch.accelerator.device_count = lambda: 1
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), WORLD), rank=rank,
                            world_size=WORLD)
    for build in (ltx, ltx2):
        compare(rank, build)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(tmp,), nprocs=WORLD)
