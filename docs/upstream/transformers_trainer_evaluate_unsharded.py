"""transformers 5.23.0: an `evaluate()` before `train()` leaves a model loaded with a data-parallel
DistributedConfig holding its gathered parameters, so the optimizer is built over them and the training is wrong.

    python docs/upstream/transformers_trainer_evaluate_unsharded.py    # 2 ranks, gloo, CPU; a tiny random Llama

`DistributedConfig(fsdp_size=2)` and `(dp_replicate_size=2)` apply FSDP2's `fully_shard`. The evaluation's
forward leaves each FSDP module unsharded (its parameters gathered), and `Trainer.train` then builds its
optimizer over those gathered parameters instead of the sharded ones: the first step's update does not reach the
parameters the next forward gathers, so from the second step on the gradient norms and weights differ from a
Trainer that did not evaluate first. The script trains two steps (two micro-batches each) twice on each layout,
without and with an evaluation first, and prints each step's gradient norm. transformers 5.24.0 reshards every
FSDP module before building the optimizer, and the two agree.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


class Rows(torch.utils.data.Dataset):
    def __init__(self, seed: int, count: int = 8):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, 128, (count, 12), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def grad_norms(folder: str, sizes: dict, evaluate_first: bool) -> list[float]:
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments
    from transformers.distributed import DistributedConfig

    norms = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "grad_norm" in logs:
                norms.append(float(logs["grad_norm"]))

    model = AutoModelForCausalLM.from_pretrained(folder, distributed_config=DistributedConfig(**sizes))
    args = TrainingArguments(output_dir=os.path.join(folder, "out"), per_device_train_batch_size=2,
                             per_device_eval_batch_size=2, max_steps=2, gradient_accumulation_steps=2, learning_rate=1e-2, logging_steps=1,
                             save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=Rows(1), eval_dataset=Rows(2), callbacks=[Record()])
    if evaluate_first:
        trainer.evaluate()
    trainer.train()
    return norms


def rank(r: int, folder: str) -> None:
    import transformers

    os.environ.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1")
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), WORLD), rank=r,
                            world_size=WORLD)
    for sizes in ({"fsdp_size": WORLD}, {"dp_replicate_size": WORLD}):
        plain, evaluated = (grad_norms(folder, sizes, first) for first in (False, True))
        if r == 0:
            print(f"transformers {transformers.__version__} {sizes}: grad_norm by step "
                  f"{', '.join(f'{n:.5f}' for n in plain)} training alone, "
                  f"{', '.join(f'{n:.5f}' for n in evaluated)} after an evaluate()")
    dist.destroy_process_group()


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        LlamaForCausalLM(config).save_pretrained(folder)
        mp.spawn(rank, args=(folder,), nprocs=WORLD)


if __name__ == "__main__":
    main()
