"""transformers 5.24.0: FalconH1 loaded with a data-parallel DistributedConfig leaves its `mup_vector` unset.

    python docs/upstream/transformers_falcon_h1_mup_vector.py     # 2 ranks, gloo, CPU; a tiny random FalconH1

Each Mamba mixer's `mup_vector` is a non-persistent buffer (not in the checkpoint) that `_init_weights` fills
from the config. Loaded with `DistributedConfig(dp_replicate_size=2)` or `(fsdp_size=2)` it holds whatever
memory it was given (garbage, or NaN under FSDP), so the logits differ from one device or are not finite;
with `tp_size=2` it is filled and the model agrees.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def rank(r: int, folder: str, sizes: dict) -> None:
    os.environ.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(WORLD))
    store = dist.FileStore(os.path.join(folder, "store-" + "-".join(sizes)), WORLD)
    dist.init_process_group("gloo", store=store, rank=r, world_size=WORLD)
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    single = AutoModelForCausalLM.from_pretrained(folder)
    parallel = AutoModelForCausalLM.from_pretrained(folder, distributed_config=DistributedConfig(**sizes))
    name = "model.layers.0.mamba.mup_vector"
    got = dict(parallel.named_buffers())[name]
    got = got.full_tensor() if hasattr(got, "full_tensor") else got
    want = dict(single.named_buffers())[name]
    print(f"rank {r} {sizes}: {name} max |parallel - one device| = {(got - want).abs().max().item():.1e}")
    dist.destroy_process_group()


def main() -> None:
    from transformers import FalconH1Config, FalconH1ForCausalLM

    config = FalconH1Config(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=4, head_dim=16, mamba_d_ssm=64,
                            mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        FalconH1ForCausalLM(config).save_pretrained(folder)
        for sizes in ({"dp_replicate_size": 2}, {"fsdp_size": 2}, {"tp_size": 2}):
            mp.spawn(rank, args=(folder, sizes), nprocs=WORLD)


if __name__ == "__main__":
    main()
