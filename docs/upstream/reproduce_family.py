"""One transformers family's tiny checkpoint (the kit's sweep builds it; a task's family by its sweep name, such as
`esmc-seq-cls`), loaded with `DistributedConfig` on 4 gloo
ranks and run forward and backward once: the reproduction the upstream pages below name by family and sizes.

    FAMILY=llama4_text python docs/upstream/reproduce_family.py /tmp/ckpt            # writes the checkpoint
    FAMILY=llama4_text SIZES=tp_size=4 torchrun --nproc-per-node 4 docs/upstream/reproduce_family.py /tmp/ckpt

It prints, on each rank, the exception the load, the forward or the backward raised, or that all three ran.
"""

import os
import sys

import torch

FAMILY = os.environ.get("FAMILY", "llama4_text")


def write(folder: str) -> None:
    from paracheck.adapters.transformers import sweep

    [family] = sweep.families([FAMILY])
    assert sweep.build(sweep.fitted(family, 4), folder) is None


def run(folder: str) -> None:
    import torch.distributed as dist
    from transformers.distributed import DistributedConfig

    from paracheck.adapters.transformers import inputs, tasks

    sizes = {k: int(v) for k, v in (item.split("=") for item in os.environ.get("SIZES", "tp_size=4").split(","))}
    dist.init_process_group("gloo")
    try:
        model = tasks.load(os.path.join(folder, FAMILY), dtype=torch.float32,
                           distributed_config=DistributedConfig(**sizes))
        batch = inputs.global_batch("base", 1, model.config.get_text_config().vocab_size)
        batch = tasks.with_labels(tasks.by_suffix(FAMILY)[1], batch, model.config, seed=1)  # the task's labels
        model(**batch, use_cache=False).loss.backward()
        print(f"rank {dist.get_rank()}: load, forward and backward ran")
    except Exception as exc:  # what the family's code raises on this layout
        print(f"rank {dist.get_rank()}: {type(exc).__name__}: {exc}".splitlines()[0])
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    (run if "RANK" in os.environ else write)(sys.argv[1])
