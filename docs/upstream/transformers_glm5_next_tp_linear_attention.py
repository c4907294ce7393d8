"""transformers 5.25.0: GLM-5-Next's TP plan splits the linear-attention layers' o_proj rowwise but not their q/k/v.

    python docs/upstream/transformers_glm5_next_tp_linear_attention.py   # 2 ranks, gloo, CPU; tiny random GLM-5-Next

`Glm5NextTextConfig.base_model_tp_plan` names `layers.*.self_attn.o_proj` rowwise, for the MLA layers, whose
`q_b_proj` and `kv_b_proj` it splits colwise. A layer of type `linear_attention` is also `self_attn`
(`Glm5NextTextLinearAttention`), so its `o_proj` is split rowwise too, while the plan has no rule for its
`q_proj`/`k_proj`/`v_proj` (nor `g_b_proj`): each rank computes every head and hands `o_proj` the whole width,
which the rank's rowwise shard (half its input columns) cannot take. One process runs; with `tp_size=2` the no_grad
forward raises "mat1 and mat2 shapes cannot be multiplied".
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=32, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
            kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=0, v_head_dim=16, qk_nope_head_dim=16,
            index_head_dim=16, index_n_heads=2, linear_head_dim=16, linear_num_heads=2, max_position_embeddings=64,
            mlp_layer_types=["dense", "sparse"], layer_types=["linear_attention", "indexed_attention"], pad_token_id=0)
VISION = dict(depth=1, hidden_size=64, num_heads=2, intermediate_size=32, out_hidden_size=64,
              projection_intermediate_size=32)


def forward(model, ids, grad: bool):
    with torch.set_grad_enabled(grad):
        return model(input_ids=ids, use_cache=False).logits


def rank(r: int, folder: str) -> None:
    os.environ.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), WORLD), rank=r,
                            world_size=WORLD)
    from transformers import Glm5NextForConditionalGeneration
    from transformers.distributed import DistributedConfig

    ids = (torch.arange(24).reshape(2, 12) * 7) % 100
    single = Glm5NextForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    print(f"rank {r}: one process: logits {tuple(forward(single, ids, False).shape)}")
    parallel = Glm5NextForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32, distributed_config=DistributedConfig(tp_size=WORLD))
    attn = parallel.model.language_model.layers[0].self_attn
    out = attn.o_proj.weight
    local = out.to_local() if hasattr(out, "to_local") else out
    print(f"rank {r}: layer 0 is {type(attn).__name__}: q_proj {tuple(attn.q_proj.weight.shape)} (whole), "
          f"o_proj local {tuple(local.shape)}")
    try:
        forward(parallel, ids, False)
        print(f"rank {r}: tp{WORLD} no_grad forward ran")
    except RuntimeError as exc:
        print(f"rank {r}: tp{WORLD} no_grad forward raised: {exc}")
    dist.destroy_process_group()


def main() -> None:
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=TEXT, vision_config=VISION)).save_pretrained(folder)
        mp.spawn(rank, args=(folder,), nprocs=WORLD)


if __name__ == "__main__":
    main()
