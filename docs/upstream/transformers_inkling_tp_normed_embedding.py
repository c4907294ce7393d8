"""transformers 5.24.0: Inkling's normed embedding under tensor parallelism raises a bare AssertionError.

    python docs/upstream/transformers_inkling_tp_normed_embedding.py   # 2 ranks, gloo, CPU; tiny random Inkling

`DistributedMixin` adds `"embed_tokens": "embedding_rowwise"` to a TP plan that does not name it, wherever
`embed_tokens` is an `nn.Embedding`. Inkling's `InklingNormedEmbedding` is one, but its forward applies an RMS norm
(`embed_norm`) to the lookup inside the module, before `EmbeddingParallel` reduces the vocabulary-parallel partial
sums after it. The norm meets a DTensor whose `_MaskPartial` placement is still pending: the first op that needs it
whole (`pow`) reduces it and releases the placement's mask, the next (`hidden_states * rsqrt(...)`) reduces the same
partial again and finds no mask (`_MaskPartial._reduce_value`: `raise AssertionError`).

Muse Glimmer's and Muse Spark's text (transformers 5.25.0) embed the same way; with FAMILY set, the kit's tiny
checkpoint of that image-text family is loaded instead (its text alone reaches the embedding):

    FAMILY=muse_glimmer-image-text python docs/upstream/transformers_inkling_tp_normed_embedding.py
"""

import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
FAMILY = os.environ.get("FAMILY", "")


def rank(r: int, folder: str) -> None:
    os.environ.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), WORLD), rank=r,
                            world_size=WORLD)
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.distributed import DistributedConfig

    auto = AutoModelForImageTextToText if FAMILY else AutoModelForCausalLM
    model = auto.from_pretrained(folder, dtype=torch.float32,
                                                 distributed_config=DistributedConfig(tp_size=WORLD))
    embed = model.get_input_embeddings()
    planned = next((v for k, v in model.tp_plan.items() if k.endswith("embed_tokens")), None)
    print(f"rank {r}: tp_plan embed_tokens = {planned!r} on a "
          f"{type(embed).__name__} (an nn.Embedding: {isinstance(embed, torch.nn.Embedding)})")
    try:
        model(torch.arange(12).reshape(1, 12) % 100, use_cache=False)
        print(f"rank {r}: the forward ran")
    except AssertionError:
        frames = traceback.extract_tb(__import__("sys").exc_info()[2])
        modeling = [f for f in frames if "modeling_" in f.filename][-1]
        print(f"rank {r}: AssertionError in {frames[-1].name} ({os.path.basename(frames[-1].filename)}), "
              f"reached from {os.path.basename(modeling.filename)} line {modeling.lineno}: {modeling.line}")
    dist.destroy_process_group()


def main() -> None:
    from transformers import InklingForCausalLM, InklingTextConfig

    config = InklingTextConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, swa_num_attention_heads=2,
                               swa_num_key_value_heads=2, swa_head_dim=16, d_rel=16, max_position_embeddings=64,
                               layer_types=["hybrid_sliding", "hybrid"], mlp_layer_types=["sparse", "sparse"],
                               intermediate_size=32, moe_intermediate_size=32, n_routed_experts=4,
                               num_experts_per_tok=2, n_shared_experts=1)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        if FAMILY:  # the kit's tiny checkpoint of that family, as its sweep writes it
            from paracheck.adapters.transformers import sweep

            [family] = sweep.families([FAMILY])
            assert sweep.build(sweep.fitted(family, WORLD), folder) is None
            for name in os.listdir(os.path.join(folder, FAMILY)):
                os.rename(os.path.join(folder, FAMILY, name), os.path.join(folder, name))
        else:
            InklingForCausalLM(config).save_pretrained(folder)
        mp.spawn(rank, args=(folder,), nprocs=WORLD)


if __name__ == "__main__":
    main()
