"""transformers 5.24.0: pipeline parallelism keeps a final norm not named `norm` on every stage (gpt_neox, phi).

    python docs/upstream/transformers_pp_final_norm.py       # 2 ranks, gloo, CPU; tiny random GPT-NeoX and Llama

`apply_pipeline_parallelism` replaces `base_model.norm` (and `embed_tokens`) by `PipelineIdentityLayer` on the
stages that do not own them, by those names, not by the model's `base_model_pp_plan`. GPT-NeoX's final norm is
`final_layer_norm`, Phi's `final_layernorm`: every stage before the last applies it to the hidden state it
sends on, so the logits differ from one device. Llama (its norm is `norm`) agrees.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def rank(r: int, folder: str, norm: str) -> None:
    os.environ.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), WORLD), rank=r,
                            world_size=WORLD)
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    ids = torch.arange(12).reshape(1, 12) % 100
    single = AutoModelForCausalLM.from_pretrained(folder)
    parallel = AutoModelForCausalLM.from_pretrained(folder, distributed_config=DistributedConfig(pp_size=2))
    with torch.no_grad():
        want, got = single(ids, use_cache=False).logits, parallel(ids, use_cache=False).logits
    kept = type(getattr(parallel.base_model, norm)).__name__
    print(f"rank {r}: {type(single).__name__} {norm} on this stage: {kept}; "
          f"max |logits - one device| = {(got - want).abs().max().item():.1e}")
    dist.destroy_process_group()


def main() -> None:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM

    sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4)
    for model_class, config, norm in ((GPTNeoXForCausalLM, GPTNeoXConfig(**sizes), "final_layer_norm"),
                                      (LlamaForCausalLM, LlamaConfig(**sizes), "norm")):
        torch.manual_seed(0)
        with tempfile.TemporaryDirectory() as folder:
            model_class(config).save_pretrained(folder)
            mp.spawn(rank, args=(folder, norm), nprocs=WORLD)


if __name__ == "__main__":
    main()
