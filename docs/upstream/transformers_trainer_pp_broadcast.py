"""transformers 5.24.0: Trainer.train() aborts a pipeline-parallel world (DistributedConfig(pp_size=2)).

    python docs/upstream/transformers_trainer_pp_broadcast.py       # 2 ranks, gloo, CPU; a tiny random Llama

For a model loaded with `distributed_config`, `Trainer._inner_training_loop` calls
`_sync_replicated_trainable_parameters`, which broadcasts every trainable parameter that is not a DTensor from
rank 0 over the whole world. Under pipeline parallelism each stage holds its own layers (plain tensors), so rank
0 sends its embedding (128 x 64) while rank 1 expects its first layer's q_proj (64 x 64): gloo aborts the process
("Received data size doesn't match expected size").
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def rank(r: int, folder: str) -> None:
    os.environ.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), WORLD), rank=r,
                            world_size=WORLD)
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, default_data_collator
    from transformers.distributed import DistributedConfig

    model = AutoModelForCausalLM.from_pretrained(os.path.join(folder, "model"),
                                                 distributed_config=DistributedConfig(pp_size=WORLD))
    ids = torch.randint(1, 128, (8, 12), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(output_dir=os.path.join(folder, f"out{r}"), per_device_train_batch_size=2, max_steps=1,
                             use_cpu=True, save_strategy="no", report_to=[], train_sampling_strategy="sequential")
    Trainer(model=model, args=args, train_dataset=rows, data_collator=default_data_collator).train()
    print(f"rank {r}: trained one step")  # not reached: the process aborts inside train()
    dist.destroy_process_group()


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=16)
    with tempfile.TemporaryDirectory() as folder:
        LlamaForCausalLM(config).save_pretrained(os.path.join(folder, "model"))
        try:
            mp.spawn(rank, args=(folder,), nprocs=WORLD)
        except Exception as exc:  # torch.multiprocessing names the signal that ended a rank
            print(f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
