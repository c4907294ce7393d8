"""transformers 5.25.0: Param2MoE's and SarvamMoE's q_norm/k_norm keep TP-partial gradients (no plan rule for them).

    python docs/upstream/transformers_param2moe_tp_qk_norm.py   # 2 ranks, gloo, CPU; tiny random Param2MoE

Both configs' `base_model_tp_plan` split `q_proj` and `k_proj` colwise, so each rank holds its share of the heads,
and `q_norm`/`k_norm` (`use_qk_norm`: an RMSNorm over `head_dim`, one weight for every head) see only those heads.
Qwen3's causal plan marks both norms `replicated_with_grad_allreduce`; these two plans do not, so each rank's norm
gradient is its heads' share, never reduced. Loss agrees with one device; the norm gradients do not, and their sum
over the ranks does. The checkpoint is saved in the model's own format (`save_original_format=False`): a TP load of
the original (fused `query_key_value`) format raises first (docs/upstream/transformers_sharded_load_conversion.md).
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def grads(model, ids):
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    out = {}
    for name, param in model.named_parameters():
        if name.endswith(("q_norm.weight", "k_norm.weight")) and "layers.0." in name:
            grad = param.grad
            out[name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    return loss.detach(), out


def rank(r: int, folder: str) -> None:
    os.environ.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), WORLD), rank=r,
                            world_size=WORLD)
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    ids = (torch.arange(24).reshape(2, 12) * 7) % 100
    single = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    parallel = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                    distributed_config=DistributedConfig(tp_size=WORLD))
    (want_loss, want), (got_loss, got) = grads(single, ids), grads(parallel, ids)
    print(f"rank {r}: |loss - one device| = {(got_loss - want_loss).abs().item():.1e}")
    for name in want:
        summed = got[name].clone()
        dist.all_reduce(summed)
        print(f"rank {r}: {name}: |grad - one device| = {(got[name] - want[name]).abs().max().item():.1e}, "
              f"|sum over ranks - one device| = {(summed - want[name]).abs().max().item():.1e}")
    dist.destroy_process_group()


def main() -> None:
    from transformers import AutoModelForCausalLM, Param2MoeConfig

    config = Param2MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                             n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():  # norm weights drawn away from ones, so every head's share differs
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(1.0, 0.2)
        model.save_pretrained(folder, save_original_format=False)
        mp.spawn(rank, args=(folder,), nprocs=WORLD)


if __name__ == "__main__":
    main()
