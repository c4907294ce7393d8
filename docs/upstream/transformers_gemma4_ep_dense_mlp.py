"""transformers 5.24.0: Gemma4's `base_model_ep_plan` repeats its dense MLP's tensor-parallel rules (gate_proj,
up_proj colwise; down_proj rowwise), so under expert parallelism the dense MLP is sharded over the *expert* mesh;
with FSDP on it too (fsdp_size > 1), FSDP2 composes the fsdp mesh with that ep mesh, which overlaps it, and raises.

    python docs/upstream/transformers_gemma4_ep_dense_mlp.py /tmp/ckpt      # writes the tiny MoE checkpoint
    torchrun --nproc-per-node 4 docs/upstream/transformers_gemma4_ep_dense_mlp.py /tmp/ckpt
"""

import os
import sys

import torch


def write(folder: str) -> None:
    from paracheck.adapters.transformers import sweep

    [family] = sweep.families(["gemma4_text"])
    assert sweep.build(sweep.fitted(family, 4), folder) is None  # enable_moe_block on, 4 experts


def load(folder: str) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    dist.init_process_group("gloo")
    try:
        AutoModelForCausalLM.from_pretrained(os.path.join(folder, "gemma4_text"), dtype=torch.float32,
                                             distributed_config=DistributedConfig(fsdp_size=4, ep_size=2))
        print(f"rank {dist.get_rank()}: loaded")
    except RuntimeError as exc:  # Cannot concatenate overlapping meshes: [DeviceMesh((fsdp=4)...), DeviceMesh((ep=2)...)]
        print(f"rank {dist.get_rank()}: {exc}".splitlines()[0])
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    (load if "RANK" in os.environ else write)(sys.argv[1])
