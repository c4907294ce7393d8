"""transformers 5.25.0: the Trainer scales a sequence-classification head's loss as if it were summed over
`num_items_in_batch`, but the head returns a per-batch mean: on a data-parallel world the loss and the gradients are
dp times too large, and with gradient accumulation they are not divided by the micro-batch count.

    python docs/upstream/transformers_trainer_mean_loss_scaled.py    # one process, then 2 gloo ranks; CPU

`Trainer` takes a model whose forward has `**kwargs` as one whose loss reads `num_items_in_batch`
(`model_accepts_loss_kwargs`), so `compute_loss` multiplies the loss by the data-parallel degree and `training_step`
skips its division by `gradient_accumulation_steps`. `LlamaForSequenceClassification`'s forward
(`GenericForSequenceClassification`) has `**kwargs` but calls its loss without them: a mean over its own rows. The
script takes one Trainer step of a tiny random Llama head on the same 4 rows: on one process (one micro-batch of 4,
then two of 2), on 2 DDP ranks of 2 rows each, and, as the fix, on 2 ranks with `accepts_loss_kwargs = False`; each
prints the logged loss and gradient norm and the model's own mean loss on the 4 rows.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
ROWS = 4


class Rows(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(1, 128, (ROWS, 12), generator=g)
        self.labels = torch.randint(0, 3, (ROWS,), generator=g)

    def __len__(self):
        return ROWS

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def step(folder: str, rows: int, micro: int, accepts: bool | None = None) -> tuple[float, float]:
    """One Trainer step (`rows` a device batch, `micro` micro-batches): its logged loss and gradient norm."""
    from transformers import (AutoModelForSequenceClassification, PrinterCallback, Trainer, TrainerCallback,
                              TrainingArguments)
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    model = AutoModelForSequenceClassification.from_pretrained(folder)
    if accepts is not None:
        model.accepts_loss_kwargs = accepts
    args = TrainingArguments(output_dir=os.path.join(folder, "out"), per_device_train_batch_size=rows,
                             gradient_accumulation_steps=micro, max_steps=1, learning_rate=1e-3, max_grad_norm=1e9,
                             logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                             train_sampling_strategy="sequential")
    logged = []

    class Log(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if "loss" in logs:
                logged.append(logs)

    trainer = Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[Log()])
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return logged[0]["loss"], logged[0]["grad_norm"]


def rank(r: int, folder: str) -> None:
    os.environ.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ["REPRO_PORT"])
    ddp = step(folder, ROWS // WORLD, 1)
    fixed = step(folder, ROWS // WORLD, 1, accepts=False)
    if r == 0:
        print(f"2 DDP ranks, 2 rows each:              loss {ddp[0]:.4f}, grad norm {ddp[1]:.4f}")
        print(f"2 DDP ranks, accepts_loss_kwargs=False: loss {fixed[0]:.4f}, grad norm {fixed[1]:.4f}")
    if dist.is_initialized():
        dist.destroy_process_group()


def main() -> None:
    from transformers import AutoModelForSequenceClassification, LlamaConfig, LlamaForSequenceClassification

    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, num_labels=3, pad_token_id=0)
    with tempfile.TemporaryDirectory() as folder:
        LlamaForSequenceClassification(config).save_pretrained(folder)
        data = Rows()
        with torch.no_grad():
            mean = AutoModelForSequenceClassification.from_pretrained(folder)(input_ids=data.ids,
                                                                             labels=data.labels).loss
        print(f"the model's own mean loss on the {ROWS} rows: {float(mean):.4f}")
        whole, halves = step(folder, ROWS, 1), step(folder, ROWS // 2, 2)
        print(f"1 process, one micro-batch of {ROWS}:      loss {whole[0]:.4f}, grad norm {whole[1]:.4f}")
        print(f"1 process, two micro-batches of 2:     loss {halves[0]:.4f}, grad norm {halves[1]:.4f}")
        os.environ["REPRO_PORT"] = "29517"
        mp.spawn(rank, args=(folder,), nprocs=WORLD)


if __name__ == "__main__":
    main()
