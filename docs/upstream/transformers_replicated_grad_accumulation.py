"""transformers 5.25.0: a `replicated_with_grad_allreduce` weight's gradient is all-reduced again at every
micro-batch of gradient accumulation, so earlier micro-batches count tp times.

    python docs/upstream/transformers_replicated_grad_accumulation.py    # 2 ranks, gloo, CPU; a tiny random Qwen3

`ReplicatedWithGradAllReduce` (distributed/tensor_parallel.py; Qwen3's per-head q_norm/k_norm) registers a
post-accumulate-grad hook that all-reduces `param.grad` over the TP group. A hook of that kind runs after each
backward has added into `param.grad`: with two micro-batches, the second all-reduce sums the first micro-batch's
already reduced gradient once per rank again. The script takes two backwards on the TP model and on one process
and prints, per weight kind, the largest gradient difference and the factor the TP gradient is off by.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, 128, (2, 12), generator=g) for _ in range(2)]


def accumulate(model, micro: int = 2) -> dict:
    model.zero_grad(set_to_none=True)
    for ids in batches()[:micro]:  # micro-batches, as gradient accumulation takes them
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        grads[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()
    return grads


def rank(r: int, folder: str) -> None:
    os.environ.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), WORLD), rank=r,
                            world_size=WORLD)
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    single = accumulate(AutoModelForCausalLM.from_pretrained(folder))
    first = accumulate(AutoModelForCausalLM.from_pretrained(folder), micro=1)  # the first micro-batch alone
    parallel = accumulate(AutoModelForCausalLM.from_pretrained(
        folder, distributed_config=DistributedConfig(tp_size=WORLD)))
    if r == 0:
        for kind in ("self_attn.q_norm.weight", "self_attn.k_norm.weight", "self_attn.q_proj.weight",
                     "mlp.down_proj.weight"):
            name = f"model.layers.0.{kind}"
            a, b = parallel[name], single[name]
            factor = float((a * b).sum() / (b * b).sum())
            s1 = first[name]
            counted = a - (b + (WORLD - 1) * s1)  # the TP gradient less S1 + S2 + (tp - 1) S1
            print(f"{name}: max |tp - one process| {float((a - b).abs().max()):.2e}, tp gradient = {factor:.3f} x; "
                  f"max |tp - (one process + (tp - 1) x first micro-batch)| {float(counted.abs().max()):.2e}")
    dist.destroy_process_group()


def main() -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=16)
    with tempfile.TemporaryDirectory() as folder:
        Qwen3ForCausalLM(config).save_pretrained(folder)
        mp.spawn(rank, args=(folder,), nprocs=WORLD)


if __name__ == "__main__":
    main()
