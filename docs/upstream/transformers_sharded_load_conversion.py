"""transformers 5.24.0: `from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=4))` applies a checkpoint
conversion to each rank's FSDP shard of the tensors instead of the whole tensors. A conversion that concatenates
(OlmoHybrid, KimiLinear and BailingHybrid stack q_conv1d, k_conv1d and v_conv1d into one conv1d) builds each shard
from the three tensors' shards, so the rows land in the wrong order and the model computes wrong numbers with no
warning; one that splits (SarvamMoe's query_key_value, LaraMini's in_proj_qkv) raises. One process loads right.
Each family loads with the class its checkpoint names (an image-text or audio model too): a chunk (Step3p7's and Unlimited-OCR's vision qkv) is
silently wrong (and Nemotron-H Omni's RADIO qkv), a transpose (Ovis2.5's visual embedding table) raises.

    FAMILY=ovis2_5-image-text python docs/upstream/transformers_sharded_load_conversion.py /tmp/ckpt   # then torchrun

    FAMILY=olmo_hybrid python docs/upstream/transformers_sharded_load_conversion.py /tmp/ckpt   # the checkpoint
    FAMILY=olmo_hybrid torchrun --nproc-per-node 4 docs/upstream/transformers_sharded_load_conversion.py /tmp/ckpt
"""

import os
import sys

import torch

FAMILY = os.environ.get("FAMILY", "olmo_hybrid")


def write(folder: str) -> None:
    from paracheck.adapters.transformers import sweep

    [family] = sweep.families([FAMILY])
    assert sweep.build(sweep.fitted(family, 4), folder) is None


def load(folder: str) -> None:
    import torch.distributed as dist
    import transformers
    from transformers.distributed import DistributedConfig

    dist.init_process_group("gloo")
    path = os.path.join(folder, FAMILY)
    try:
        # the class the checkpoint names: a causal LM, or nemo_speechlm-audio-text's audio model
        klass = getattr(transformers, transformers.AutoConfig.from_pretrained(path).architectures[0])
        one = dict(klass.from_pretrained(path, dtype=torch.float32).named_parameters())
        sharded = klass.from_pretrained(
            path, dtype=torch.float32, distributed_config=DistributedConfig(fsdp_size=dist.get_world_size()))
        for name, param in sharded.named_parameters():
            whole = param.full_tensor() if hasattr(param, "full_tensor") else param
            off = (whole - one[name]).abs().max().item()
            if off and dist.get_rank() == 0:  # olmo_hybrid: model.layers.0.linear_attn.conv1d.weight 8.6e-02
                print(f"{name} loaded wrong: max |sharded - one process| {off:.1e}")
    except RuntimeError as exc:  # sarvam_moe: "split_with_sizes expects ..."; ovis2_5: "... ignore_mismatched_sizes"
        print(f"rank {dist.get_rank()}: {exc}".splitlines()[0])
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    (load if "RANK" in os.environ else write)(sys.argv[1])
