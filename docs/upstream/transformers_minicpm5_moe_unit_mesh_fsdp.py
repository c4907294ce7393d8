"""MiniCPM5-MoE cannot load with tensor parallelism and a data-parallel dimension (transformers 5.25.0).

Its TP plan runs the key and value projections `unit_colwise`, which shards their weights on a private "unit mesh"
(`mesh_manager.get_unit_mesh`), not a slice of the dense mesh. `fully_shard` then has to concatenate its FSDP mesh
with that parameter's mesh and raises `Cannot concatenate DeviceMeshes derived from different device meshs`.
tp_size=4 alone and the data-parallel layouts alone load. Runs on 4 CPU processes (gloo), no kit:

    USE_HUB_KERNELS=0 python3 transformers_minicpm5_moe_unit_mesh_fsdp.py
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = dict(head_dim=16, hidden_size=64, intermediate_size=32, max_position_embeddings=64, moe_intermediate_size=32,
             mlp_layer_types=["dense", "sparse", "dense", "sparse"], n_routed_experts=4, num_attention_heads=8,
             num_experts_per_tok=2, num_hidden_layers=4, num_key_value_heads=4, vocab_size=128)


def rank(r, path, layout):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29741", RANK=str(r), WORLD_SIZE="4", LOCAL_RANK=str(r))
    dist.init_process_group("gloo", rank=r, world_size=4)
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    try:
        AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(**layout))
        outcome = "loads"
    except RuntimeError as exc:
        outcome = f"raises RuntimeError: {exc}"
    if r == 0:
        print(layout, outcome, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    from transformers import MiniCPM5MoeConfig, MiniCPM5MoeForCausalLM

    with tempfile.TemporaryDirectory() as path:
        torch.manual_seed(0)
        MiniCPM5MoeForCausalLM(MiniCPM5MoeConfig(**SIZES)).save_pretrained(path)
        for layout in (dict(tp_size=4), dict(fsdp_size=4), dict(tp_size=2, fsdp_size=2),
                       dict(tp_size=2, dp_replicate_size=2)):
            mp.spawn(rank, args=(path, layout), nprocs=4)
