"""transformers 5.25.0: `from_pretrained` on one process makes a parameter the model froze in `__init__` trainable;
loaded with `DistributedConfig(fsdp_size=...)`, the same parameter stays frozen.

    python docs/upstream/transformers_load_unfreezes_frozen_params.py  # 2 ranks, gloo, CPU; a tiny Qwen2-Audio

Whisper-style audio encoders (Qwen2-Audio's, Voxtral's, AudioFlamingo3's, MusicFlamingo's, MOSS's) freeze their
sinusoidal position table in `__init__` (`self.embed_positions.requires_grad_(False)`). Loading a checkpoint
replaces each parameter: for a plain one `core_model_loading.set_param_for_module` wraps the loaded tensor in a new
`nn.Parameter(..., requires_grad=param_value.is_floating_point())` (core_model_loading.py:1590), dropping the flag;
for a DTensor (every parameter FSDP shards) it keeps `requires_grad=ref.requires_grad` (core_model_loading.py:1610).
So one process trains the position table and an FSDP run of the same checkpoint does not: their gradients and
every training step differ.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def build(folder: str) -> None:
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    config = Qwen2AudioConfig(
        audio_config=dict(encoder_layers=1, encoder_attention_heads=2, d_model=32, encoder_ffn_dim=32,
                          num_mel_bins=16, max_source_positions=8),
        text_config=dict(model_type="qwen2", vocab_size=128, hidden_size=64, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2),
        audio_token_index=127)
    model = Qwen2AudioForConditionalGeneration(config)
    print("built by __init__:        embed_positions.requires_grad =",
          model.model.audio_tower.embed_positions.weight.requires_grad, flush=True)
    model.save_pretrained(folder)


def frozen(model) -> bool:
    return model.model.audio_tower.embed_positions.weight.requires_grad


def rank(r: int, folder: str) -> None:
    os.environ.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), WORLD), rank=r,
                            world_size=WORLD)
    from transformers import Qwen2AudioForConditionalGeneration
    from transformers.distributed import DistributedConfig

    single = Qwen2AudioForConditionalGeneration.from_pretrained(folder)
    sharded = Qwen2AudioForConditionalGeneration.from_pretrained(
        folder, distributed_config=DistributedConfig(fsdp_size=WORLD))
    if r == 0:
        print("from_pretrained, 1 process: embed_positions.requires_grad =", frozen(single), flush=True)
        print("from_pretrained, FSDP 2:    embed_positions.requires_grad =", frozen(sharded), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as folder:
        build(folder)
        mp.spawn(rank, args=(folder,), nprocs=WORLD)
