"""transformers 5.25.0: a sharded (FSDP) load concatenates a checkpoint's separate tensors per shard, so a fused
parameter silently gets the wrong rows.

    python docs/upstream/transformers_sharded_load_fused_concat.py   # 2 ranks, gloo, CPU; tiny random MiniMax-M3-VL

MiniMax-M3-VL's model fuses each shared expert's `gate_proj` and `up_proj` into one `gate_up_proj` (64, 64 here);
its conversion mapping writes them as two (32, 64) tensors in the checkpoint (`save_pretrained`) and concatenates
them back on load. Loaded with `DistributedConfig(fsdp_size=2)`, each rank's shard of `gate_up_proj` is made of
that rank's shard of `gate_proj` followed by its shard of `up_proj`, not of its rows of the whole concatenation: the
gathered parameter is gate[0:16], up[0:16], gate[16:32], up[16:32]. No error is raised; every forward is wrong.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
NAME = "model.language_model.layers.0.mlp.shared_experts.gate_up_proj.weight"
TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64, num_experts_per_tok=2,
            num_local_experts=4, dense_intermediate_size=32, shared_intermediate_size=32, rotary_dim=8,
            mlp_layer_types=["sparse", "sparse"], index_n_heads=2, index_head_dim=16, bos_token_id=127,
            eos_token_id=127, layer_types=["full_attention", "full_attention"],
            rope_parameters=dict(rope_theta=5000000.0, rope_type="default", mrope_section=[4, 2, 2]))
VISION = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=56,
              patch_size=14, out_hidden_size=64)


def rank(r: int, folder: str) -> None:
    os.environ.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), WORLD), rank=r,
                            world_size=WORLD)
    from transformers import AutoModelForImageTextToText
    from transformers.distributed import DistributedConfig

    single = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    sharded = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32,
                                                          distributed_config=DistributedConfig(fsdp_size=WORLD))
    want = single.get_parameter(NAME).detach()
    got = sharded.get_parameter(NAME).full_tensor().detach()
    rows = [next(i for i in range(want.shape[0]) if torch.equal(got[j], want[i])) for j in range(got.shape[0])]
    print(f"rank {r}: {NAME}: |fsdp - one process| = {(got - want).abs().max().item():.2e}; "
          f"gathered rows come from the whole parameter's rows {rows[:2]}..{rows[14:18]}..{rows[-2:]}")
    ids = (torch.arange(24).reshape(2, 12) * 7) % 100
    with torch.no_grad():
        diff = (sharded(input_ids=ids).logits - single(input_ids=ids).logits).abs().max().item()
    print(f"rank {r}: text-only logits, fsdp{WORLD} against one process: {diff:.2e}")
    dist.destroy_process_group()


def main() -> None:
    from transformers import AutoModelForImageTextToText, MiniMaxM3VLConfig

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        config = MiniMaxM3VLConfig(text_config=TEXT, vision_config=VISION, image_token_index=127)
        AutoModelForImageTextToText.from_config(config).save_pretrained(folder)
        mp.spawn(rank, args=(folder,), nprocs=WORLD)


if __name__ == "__main__":
    main()
