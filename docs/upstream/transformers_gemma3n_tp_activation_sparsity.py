"""transformers 5.24.0: Gemma3n's activation sparsity under tensor parallelism takes its statistics over one shard.

    python docs/upstream/transformers_gemma3n_tp_activation_sparsity.py   # 2 ranks, gloo, CPU; tiny random Gemma3n

`Gemma3nTextMLP._gaussian_topk` keeps the activations above `mean + std * icdf(sparsity)` of `gate_proj`'s output,
the mean and the standard deviation taken over its last dimension, the intermediate width. The TP plan splits
`gate_proj` colwise, so each rank takes them over its own shard of that width: a different cutoff per rank, and
the logits differ from one device. The same model with `activation_sparsity_pattern` all zero (no top-k) agrees.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def rank(r: int, folder: str, sparsity: list) -> None:
    os.environ.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), WORLD), rank=r,
                            world_size=WORLD)
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    ids = torch.arange(12).reshape(1, 12) % 100
    single = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    parallel = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                    distributed_config=DistributedConfig(tp_size=WORLD))
    with torch.no_grad():
        want, got = single(ids, use_cache=False).logits, parallel(ids, use_cache=False).logits
    print(f"rank {r}: activation_sparsity_pattern={sparsity}; max |logits - one device| = "
          f"{(got - want).abs().max().item():.1e}")
    dist.destroy_process_group()


def main() -> None:
    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig

    sizes = dict(vocab_size=128, vocab_size_per_layer_input=128, hidden_size=64, hidden_size_per_layer_input=16,
                 intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, laurel_rank=16, num_kv_shared_layers=0, max_position_embeddings=64,
                 layer_types=["sliding_attention", "full_attention"])
    for sparsity in ([0.95, 0.0], [0.0, 0.0]):
        torch.manual_seed(0)
        with tempfile.TemporaryDirectory() as folder:
            Gemma3nForCausalLM(Gemma3nTextConfig(**sizes, activation_sparsity_pattern=sparsity)).save_pretrained(folder)
            mp.spawn(rank, args=(folder, sparsity), nprocs=WORLD)


if __name__ == "__main__":
    main()
