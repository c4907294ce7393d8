"""transformers 5.24.0: pipeline parallelism hands the next stage one tensor, the base model's last hidden state.

    python docs/upstream/transformers_pp_stage_handoff.py   # 2 ranks, gloo, CPU; tiny random models, 1 layer a stage

`pipeline_parallel_naive_forward` runs the whole base-model forward on every stage, the layers it does not own
swapped for `PipelineIdentityLayer` (which returns its first argument), and sends the next stage
`last_hidden_state`, which that stage takes as `inputs_embeds` (`input_ids` dropped). What else a model's layers
carry from one to the next is lost:

- GlmMoeDsa, HYV4: each decoder layer returns `(hidden_states, topk_indices)` (the indexer's top-k, shared with
  the next layer); an identity layer returns the hidden states alone, and the model's
  `hidden_states, topk_indices = decoder_layer(...)` raises `ValueError: too many values to unpack (expected 2)`.
- DeepseekV4: its hash-routed MoE layers (`mlp_layer_types` "hash_moe") route by `tid2eid[input_ids]`; a stage
  after the first has no `input_ids`: `AttributeError: 'NoneType' object has no attribute 'reshape'`.
- Gemma3nText: its layers carry `altup_num_inputs` streams and per-layer token embeddings read from `input_ids`;
  each stage collapses the streams (the altup unembedding and mean) before it sends, the next re-expands the one
  it gets and has no per-layer token embeddings: the logits differ from one device, silently.

Llama, whose stages hand on exactly what its next layer reads, agrees.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
              head_dim=16, max_position_embeddings=64, tie_word_embeddings=False)
MOE = dict(moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
           topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
           index_head_dim=16, index_n_heads=4)
MODELS = {
    "GlmMoeDsa": dict(COMMON, **MOE, intermediate_size=32, mlp_layer_types=["dense", "sparse"]),
    "HYV4": dict(COMMON, **MOE, intermediate_size=32, mlp_layer_types=["dense", "sparse"],
                 indexer_types=["full", "shared"], pad_token_id=0, bos_token_id=0, eos_token_id=1),
    "DeepseekV4": dict(COMMON, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                       n_shared_experts=1, q_lora_rank=16, o_lora_rank=16, index_n_heads=4, index_head_dim=16,
                       layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
                       mlp_layer_types=["moe", "hash_moe"]),
    "Gemma3nText": dict(COMMON, num_key_value_heads=2, intermediate_size=32, vocab_size_per_layer_input=128,
                        hidden_size_per_layer_input=16, laurel_rank=16, num_kv_shared_layers=0,
                        layer_types=["sliding_attention", "full_attention"], activation_sparsity_pattern=[0.0, 0.0]),
    "Llama": dict(COMMON, intermediate_size=32),
}


def rank(r: int, folder: str, name: str) -> None:
    os.environ.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), WORLD), rank=r,
                            world_size=WORLD)
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    ids = torch.arange(36).reshape(3, 12) % 100  # batch 3: a tensor unpacked into two values unpacks its batch dim
    single = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    parallel = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                    distributed_config=DistributedConfig(pp_size=WORLD))
    with torch.no_grad():
        want = single(ids, use_cache=False).logits
        try:
            got = parallel(ids, use_cache=False).logits
            print(f"rank {r}: {name}: max |logits - one device| = {(got - want).abs().max().item():.1e}", flush=True)
        except Exception as exc:  # what the stage raised; the other stage then waits on it, so it is ended here
            print(f"rank {r}: {name}: {type(exc).__name__}: {exc}".splitlines()[0], flush=True)
            os._exit(1)
    dist.destroy_process_group()


def main() -> None:
    import transformers

    for name, sizes in MODELS.items():
        config = getattr(transformers, f"{name}Config")(**sizes)
        torch.manual_seed(0)
        with tempfile.TemporaryDirectory() as folder:
            transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
            try:
                mp.spawn(rank, args=(folder, name), nprocs=WORLD)
            except mp.ProcessExitedException:
                pass  # the stage that raised ended itself (printed above)


if __name__ == "__main__":
    main()
