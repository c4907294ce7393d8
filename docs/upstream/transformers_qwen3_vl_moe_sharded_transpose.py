"""transformers 5.25.0: a sharded load of Qwen3-VL-MoE transposes experts already in the model's layout.

    python docs/upstream/transformers_qwen3_vl_moe_sharded_transpose.py   # 2 ranks, gloo, CPU; tiny random model

The `qwen3_vl_moe` entry of `conversion_mapping.py` converts `mlp.experts.gate_up_proj` and `mlp.experts.down_proj`
with `Transpose(1, 2, check_dims=True)`: transpose unless the checkpoint's tensor already has the parameter's
shape. Under `DistributedConfig(fsdp_size=N)` (or an `ep_size`) the loader hands it each rank's shard of the
experts, (E/N, ...), and compares it with the parameter's whole shape, (E, ...): they never agree, so a checkpoint
in the model's own layout (what `save_pretrained` writes) is transposed. `down_proj` (E, hidden, moe_intermediate)
then has the wrong shape and `from_pretrained` raises (MISMATCH in the load report, then `RuntimeError: You set
ignore_mismatched_sizes to False`). One process loads it; so does a checkpoint in the original (transposed) layout,
which the wrong test transposes back by accident.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def rank(r: int, folder: str) -> None:
    os.environ.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), WORLD), rank=r,
                            world_size=WORLD)
    from transformers import Qwen3VLMoeForConditionalGeneration
    from transformers.distributed import DistributedConfig

    one = dict(Qwen3VLMoeForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).named_parameters())
    for layout in ("model", "original"):
        path = os.path.join(folder, layout)
        try:
            model = Qwen3VLMoeForConditionalGeneration.from_pretrained(
                path, dtype=torch.float32, distributed_config=DistributedConfig(fsdp_size=WORLD))
            off = max((p.full_tensor() - one[n]).abs().max().item() for n, p in model.named_parameters())
            print(f"rank {r}: {layout} layout: loaded, max |sharded - one process| = {off:.1e}")
        except RuntimeError as exc:
            print(f"rank {r}: {layout} layout: {type(exc).__name__}: {exc}".splitlines()[0])
    dist.destroy_process_group()


def main() -> None:
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    text = dict(vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=64, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                                mrope_section=[4, 2, 2]))
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  deepstack_visual_indexes=[0])
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        model = Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig(text_config=text, vision_config=vision))
        model.save_pretrained(folder)  # the model's layout: down_proj (4, 64, 32)
        model.save_pretrained(os.path.join(folder, "model"))
        model.save_pretrained(os.path.join(folder, "original"))
        weights = os.path.join(folder, "original", "model.safetensors")
        tensors = load_file(weights)  # the released checkpoints' layout: experts transposed, down_proj (4, 32, 64)
        save_file({k: v.transpose(1, 2).contiguous() if ".mlp.experts." in k else v for k, v in tensors.items()},
                  weights, metadata={"format": "pt"})
        mp.spawn(rank, args=(folder,), nprocs=WORLD)


if __name__ == "__main__":
    main()
