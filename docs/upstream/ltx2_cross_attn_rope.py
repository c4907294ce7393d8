"""diffusers 0.42.1: LTX-2's _cp_plan splits the video rotary table but not the cross-attention one.

    python docs/upstream/ltx2_cross_attn_rope.py            # 2 ranks, gloo, CPU

`LTX2VideoTransformer3DModel.forward` builds four rotary tables: `rope` (video self-attention), `audio_rope`, and
`cross_attn_rope` / `cross_attn_audio_rope` for the audio-video cross-attention. Its `_cp_plan` splits
`hidden_states` on the sequence and `rope`'s output with it, but not `cross_attn_rope`'s, so the audio-to-video
and video-to-audio attention apply the whole video's rotary rows to this rank's share of the video tokens. Runs a
tiny transformer from its config, Ulysses 2 and no encoder mask (LTX's mask fails under Ulysses for another
reason), with the modalities isolated (no cross-attention: exact) and not (the model's default: raises).
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD, SIDE = 2, 4


def model():
    from diffusers import LTX2VideoTransformer3DModel

    torch.manual_seed(0)
    return LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
        audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2, audio_attention_head_dim=4,
        audio_cross_attention_dim=8, num_layers=1, caption_channels=16, rope_double_precision=False).eval()


def inputs(isolate: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    return dict(hidden_states=torch.randn(1, SIDE * SIDE, 4, generator=g),
                audio_hidden_states=torch.randn(1, 4, 4, generator=g),
                encoder_hidden_states=torch.randn(1, 8, 16, generator=g),
                audio_encoder_hidden_states=torch.randn(1, 4, 16, generator=g), timestep=torch.tensor([500.0]),
                encoder_attention_mask=None, num_frames=1, height=SIDE, width=SIDE, audio_num_frames=4, fps=25.0,
                isolate_modalities=isolate, return_dict=False)


def worker(rank, tmp):
    from diffusers import ContextParallelConfig

    torch.set_num_threads(1)
    # enable_parallelism picks `rank % torch.accelerator.device_count()`: a modulo by zero on a CPU-only machine.
    torch.accelerator.device_count = lambda: 1
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), WORLD), rank=rank,
                            world_size=WORLD)
    reference, parallel = model(), model()
    parallel.enable_parallelism(config=ContextParallelConfig(ulysses_degree=WORLD))
    for isolate in (True, False):
        with torch.no_grad():
            want = reference(**inputs(isolate))[0]
            try:
                got = parallel(**inputs(isolate))[0]
                line = f"max abs difference {float((got - want).abs().max()):.1e}"
            except RuntimeError as exc:
                line = f"RuntimeError: {exc}"
        if rank == 0:
            print(f"isolate_modalities={isolate}: {line}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(tmp,), nprocs=WORLD)
