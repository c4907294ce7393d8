"""transformers 5.24.0: DistributedConfig(pp_size=2, tp_size=2) raises KeyError while loading.

    python docs/upstream/transformers_pp_tp_keyerror.py       # 4 ranks, gloo, CPU; a tiny random Llama

`maybe_distribute_model` resolves and expands the TP plan over the whole model, then applies pipeline
parallelism (which swaps the layers this stage does not own for `PipelineIdentityLayer`), then applies the
expanded TP plan: its first rule for a swapped-out layer is no longer a module or parameter of the model.
pp_size=2 alone and tp_size=2 alone load and run.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 4


def rank(r: int, folder: str, sizes: dict) -> None:
    os.environ.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), WORLD), rank=r,
                            world_size=WORLD)
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    try:
        AutoModelForCausalLM.from_pretrained(folder, distributed_config=DistributedConfig(**sizes))
        outcome = "loaded"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    if r == 0:
        print(f"{sizes}: {outcome}")
    dist.destroy_process_group()


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=16)
    for sizes in ({"pp_size": 4}, {"tp_size": 4}, {"pp_size": 2, "tp_size": 2}):
        with tempfile.TemporaryDirectory() as folder:
            LlamaForCausalLM(config).save_pretrained(folder)
            mp.spawn(rank, args=(folder, sizes), nprocs=WORLD)


if __name__ == "__main__":
    main()
