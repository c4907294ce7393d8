"""transformers 5.24.0: save_pretrained from a DistributedConfig model with tied embeddings writes lm_head.weight.

    python docs/upstream/transformers_tied_gathered_save.py       # 2 ranks, gloo, CPU; a tiny random tied Llama

On one device, `save_pretrained` of a model whose output head is tied to its input embedding writes the shared
tensor once (`model.embed_tokens.weight`). Loaded with `DistributedConfig` (tp or fsdp), every rank calls
`save_pretrained(dir)`, `gather_sharded_state_dict_for_save` gathers each DTensor whole and rank 0 writes: the two
names now hold two gathered tensors, no longer one storage, so both are written. The checkpoint's names differ
from the single-device model's (one more tensor); reading it back on one device raises nothing and the values
are the same.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def keys(path: str) -> set:
    from safetensors import safe_open

    found = set()
    for file in os.listdir(path):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(path, file), "pt") as handle:
                found |= set(handle.keys())
    return found


def rank(r: int, folder: str, sharding: dict) -> None:
    os.environ.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(WORLD))
    store = dist.FileStore(os.path.join(folder, "store-" + "-".join(sharding)), WORLD)
    dist.init_process_group("gloo", store=store, rank=r, world_size=WORLD)
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    model = AutoModelForCausalLM.from_pretrained(os.path.join(folder, "model"), dtype=torch.float32,
                                                 distributed_config=DistributedConfig(**sharding))
    saved = os.path.join(folder, "saved-" + "-".join(sharding))
    model.save_pretrained(saved)
    dist.barrier()
    if r == 0:
        extra = sorted(keys(saved) - keys(os.path.join(folder, "model")))
        print(f"{sharding}: save_pretrained wrote {len(keys(saved))} tensors, the single-device save "
              f"{len(keys(os.path.join(folder, 'model')))}; extra: {extra}")
    dist.destroy_process_group()


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=16, tie_word_embeddings=True)
    with tempfile.TemporaryDirectory() as folder:
        LlamaForCausalLM(config).save_pretrained(os.path.join(folder, "model"))
        for sharding in ({"tp_size": WORLD}, {"fsdp_size": WORLD}):
            mp.spawn(rank, args=(folder, sharding), nprocs=WORLD)


if __name__ == "__main__":
    main()
