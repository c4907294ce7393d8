"""transformers 5.25.0: greedy generate under pipeline parallelism parts from one process on a left-padded batch.

    python docs/upstream/transformers_pp_generate_mask.py     # 2 ranks, gloo, CPU; a tiny random Llama

Each pipeline stage runs `generate` on the whole model object, whose layers outside the stage are
`PipelineIdentityLayer`s. Every decode step builds its attention mask from the cache's first layer
(`masking_utils.create_causal_mask` -> `find_first_full_attention_index`, then `get_mask_sizes`). On the second
stage that layer is an identity layer, so its cache stays empty: the mask covers one key instead of the whole past,
and a left-padded row attends its padding. Rows without padding happen to come out right with a dynamic cache; with
a static cache every row parts. The script prints, per cache, the tokens of both runs and stage 1's cache lengths.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
NEW = 6


def prompts():
    ids = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # row 1 left-padded by 3
    return ids.masked_fill(mask == 0, 0), mask


def greedy(model, cache: str):
    ids, mask = prompts()
    extra = {"cache_implementation": "static"} if cache == "static" else {}
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                             do_sample=False, pad_token_id=0, return_dict_in_generate=True, **extra)
    return out.sequences[:, ids.shape[1]:].tolist(), out


def rank(r: int, folder: str) -> None:
    os.environ.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), WORLD), rank=r,
                            world_size=WORLD)
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    single = AutoModelForCausalLM.from_pretrained(folder)
    staged = AutoModelForCausalLM.from_pretrained(folder, distributed_config=DistributedConfig(pp_size=WORLD))
    for cache in ("dynamic", "static"):
        expected, _ = greedy(single, cache)
        actual, out = greedy(staged, cache)
        cached = getattr(out, "cache", None)
        lengths = [layer.get_seq_length() for layer in cached.layers] if cached is not None else "n/a"
        if r == WORLD - 1:
            print(f"{cache} cache, stage {r}: cached lengths per layer {lengths}")
            for row, (a, e) in enumerate(zip(actual, expected)):
                print(f"  row {row}{' (left-padded)' if row else ''}: pipeline {a} one process {e} "
                      f"{'same' if a == e else 'DIFFERENT'}")
    dist.destroy_process_group()


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=16)
    with tempfile.TemporaryDirectory() as folder:
        LlamaForCausalLM(config).save_pretrained(folder)
        mp.spawn(rank, args=(folder,), nprocs=WORLD)


if __name__ == "__main__":
    main()
