"""transformers 5.25.0: Qwen3-VL-MoE's q_norm/k_norm keep TP-partial gradients (its text plan has no rule for them).

    python docs/upstream/transformers_qwen3_vl_moe_tp_qk_norm.py   # 2 ranks, gloo, CPU; tiny random Qwen3-VL-MoE

`Qwen3VLMoeTextConfig.base_model_tp_plan` splits `q_proj` and `k_proj` colwise, so each rank holds its share of
the heads, and `q_norm`/`k_norm` (an RMSNorm over `head_dim`, one weight for every head) see only those heads.
Qwen3's and Qwen3-MoE's causal plans mark both norms `replicated_with_grad_allreduce`; Qwen3-VL-MoE's text plan
does not, so each rank's norm gradient is its heads' share, never reduced. Logits and loss agree with one device;
the norm gradients do not, and their sum over the ranks does (the all-reduce the plan leaves out).

Qwen3-Omni-MoE's thinker (transformers 5.25.0) has the same text plan; with FAMILY set, the kit's tiny checkpoint of
that image-text family is loaded instead (its text alone reaches the norms):

    FAMILY=qwen3_omni_moe_thinker-image-text python docs/upstream/transformers_qwen3_vl_moe_tp_qk_norm.py
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
FAMILY = os.environ.get("FAMILY", "")


def grads(model, ids) -> dict:
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    out = {}
    for name, param in model.named_parameters():
        if name.endswith(("q_norm.weight", "k_norm.weight")) and "layers.0." in name:
            grad = param.grad
            out[name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    return out


def rank(r: int, folder: str) -> None:
    os.environ.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), WORLD), rank=r,
                            world_size=WORLD)
    from transformers import AutoModelForImageTextToText, Qwen3VLMoeForConditionalGeneration
    from transformers.distributed import DistributedConfig

    auto = AutoModelForImageTextToText if FAMILY else Qwen3VLMoeForConditionalGeneration

    ids = (torch.arange(24).reshape(2, 12) * 7) % 100
    single = auto.from_pretrained(folder, dtype=torch.float32)
    parallel = auto.from_pretrained(
        folder, dtype=torch.float32, distributed_config=DistributedConfig(tp_size=WORLD))
    want, got = grads(single, ids), grads(parallel, ids)
    for name in want:
        summed = got[name].clone()
        dist.all_reduce(summed)
        print(f"rank {r}: {name}: |grad - one device| = {(got[name] - want[name]).abs().max().item():.1e}, "
              f"|sum over ranks - one device| = {(summed - want[name]).abs().max().item():.1e}")
    dist.destroy_process_group()


def main() -> None:
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    text = dict(vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=64, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                                mrope_section=[4, 2, 2]))
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  deepstack_visual_indexes=[0])
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        if FAMILY:  # the kit's tiny checkpoint of that family, as its sweep writes it
            from paracheck.adapters.transformers import sweep

            [family] = sweep.families([FAMILY])
            assert sweep.build(sweep.fitted(family, WORLD), folder) is None
            for name in os.listdir(os.path.join(folder, FAMILY)):
                os.rename(os.path.join(folder, FAMILY, name), os.path.join(folder, name))
            mp.spawn(rank, args=(folder,), nprocs=WORLD)
            return
        model = Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig(text_config=text, vision_config=vision))
        with torch.no_grad():  # norm weights drawn away from ones, so every head's share differs
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(1.0, 0.2)
        model.save_pretrained(folder)
        mp.spawn(rank, args=(folder,), nprocs=WORLD)


if __name__ == "__main__":
    main()
