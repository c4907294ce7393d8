"""transformers 5.24.0: save_pretrained from a pipeline-parallel model writes rank 0's stage only.

    python docs/upstream/transformers_pp_gathered_save.py       # 2 ranks, gloo, CPU; a tiny random Llama

Every rank calls `save_pretrained(dir)`, as for tp and dp. `gather_sharded_state_dict_for_save` gathers over tp
and dp but not over the pipeline stages, and only rank 0 writes: the safetensors hold stage 0's tensors. Loading
them back on one device raises nothing; the missing layers, the final norm and lm_head are initialized at random.
For contrast, the same model saved through transformers' DCP writer holds every tensor.
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
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig
    from transformers.distributed.checkpoint import _save_model_checkpoint_distributed

    one = AutoModelForCausalLM.from_pretrained(os.path.join(folder, "model"), dtype=torch.float32)
    staged = AutoModelForCausalLM.from_pretrained(os.path.join(folder, "model"), dtype=torch.float32,
                                                  distributed_config=DistributedConfig(pp_size=WORLD))
    gathered, sharded = os.path.join(folder, "gathered"), os.path.join(folder, "sharded")
    staged.save_pretrained(gathered)
    if r == 0:
        one.config.save_pretrained(sharded)
    # What save_pretrained(distributed_checkpoint=True) runs; that call itself refuses a pipeline-only model.
    _save_model_checkpoint_distributed(staged, sharded)
    dist.barrier()
    for name, path in (("save_pretrained", gathered), ("DCP writer", sharded)):
        keys = set()
        for file in os.listdir(path):
            if file.endswith(".safetensors"):
                with safe_open(os.path.join(path, file), "pt") as handle:
                    keys |= set(handle.keys())
        back = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
        worst = max(float((back[k] - v).abs().max()) for k, v in one.state_dict().items())
        if r == 0:
            print(f"{name}: {len(keys)} of {len(one.state_dict())} tensors written; read back on one device, "
                  f"max |tensor - original| = {worst:.1e}")
    dist.destroy_process_group()


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=16, tie_word_embeddings=False)
    with tempfile.TemporaryDirectory() as folder:
        LlamaForCausalLM(config).save_pretrained(os.path.join(folder, "model"))
        mp.spawn(rank, args=(folder,), nprocs=WORLD)


if __name__ == "__main__":
    main()
