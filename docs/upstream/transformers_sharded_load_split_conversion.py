"""transformers 5.24.0: `from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=4))` applies a checkpoint
conversion that splits one fused tensor into several (SarvamMoe's query_key_value into q/k/v, LaraMini's
linear_attn.in_proj_qkv) to each rank's FSDP shard instead of the whole tensor, and the load raises. The same
checkpoint loads on one process.

    python docs/upstream/transformers_sharded_load_split_conversion.py /tmp/ckpt      # writes the checkpoint
    torchrun --nproc-per-node 4 docs/upstream/transformers_sharded_load_split_conversion.py /tmp/ckpt
"""

import os
import sys

import torch

FAMILY = os.environ.get("FAMILY", "sarvam_moe")


def write(folder: str) -> None:
    from paracheck.adapters.transformers import sweep

    [family] = sweep.families([FAMILY])
    assert sweep.build(sweep.fitted(family, 4), folder) is None


def load(folder: str) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    dist.init_process_group("gloo")
    try:
        AutoModelForCausalLM.from_pretrained(os.path.join(folder, FAMILY), dtype=torch.float32,
                                             distributed_config=DistributedConfig(fsdp_size=dist.get_world_size()))
        print(f"rank {dist.get_rank()}: loaded")
    except RuntimeError as exc:  # "split_with_sizes expects split_sizes to sum exactly to 64 ... [128, 64, 64]"
        print(f"rank {dist.get_rank()}: {exc}".splitlines()[0])
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    (load if "RANK" in os.environ else write)(sys.argv[1])
