"""transformers 5.25.0: T5Gemma2 under tensor parallelism cannot train: every backward raises in its embedding.

    python docs/upstream/transformers_t5gemma2_tp_eoi_embedding.py   # 2 ranks, gloo, CPU; a tiny random T5Gemma2

`DistributedMixin` plans `embed_tokens` as `embedding_rowwise` wherever it is an `nn.Embedding`.
`T5Gemma2TextScaledWordEmbedding` is one, with a parameter of its own besides the table: `eoi_embedding`, one vector
of the hidden size, which its forward writes over the lookup wherever the ids hold `eoi_token_index`
(`input_embeddings[input_ids == eoi] = eoi_embedding`, an `index_put`, run whether or not any id matches).
`EmbeddingParallel.shard_param` shards every parameter of the module by `Shard(0)`: the table by vocabulary rows, as
meant, and `eoi_embedding` by its only dimension, the hidden one. The forward is right, with or without the token
in the ids; the backward of the `index_put` meets a plain tensor and a DTensor and raises on every rank. T5Gemma (the
first), whose embedding has no such parameter, passes the same run.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
EOI = 100  # inside the tiny vocabulary, as 256000 is inside the real 262208


def rank(r: int, folder: str) -> None:
    os.environ.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), WORLD), rank=r,
                            world_size=WORLD)
    from transformers import T5Gemma2ForConditionalGeneration
    from transformers.distributed import DistributedConfig

    model = T5Gemma2ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32,
                                                             distributed_config=DistributedConfig(tp_size=WORLD))
    ref = T5Gemma2ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    eoi = model.model.encoder.text_model.embed_tokens.eoi_embedding
    if r == 0:
        print(f"tp_plan embed_tokens: {model.tp_plan.get('model.encoder.text_model.embed_tokens')!r}; "
              f"eoi_embedding {tuple(eoi.shape)} placed {eoi.placements}")
    ids, labels = torch.arange(1, 13).reshape(1, 12), torch.arange(1, 9).reshape(1, 8)
    with_eoi = ids.clone()
    with_eoi[0, 3] = EOI
    for what, x in (("ids without the eoi token", ids), ("ids with the eoi token", with_eoi)):
        try:
            with torch.no_grad():
                got, want = (m(input_ids=x, labels=labels, use_cache=False).logits for m in (model, ref))
            print(f"rank {r}: no_grad forward, {what}: max_abs {float((got - want).abs().max()):.1e}")
        except IndexError as exc:
            print(f"rank {r}: no_grad forward, {what}: IndexError: {exc}")
    loss = model(input_ids=ids, labels=labels, use_cache=False).loss
    try:
        loss.backward()
        print(f"rank {r}: backward ran")
    except RuntimeError as exc:
        print(f"rank {r}: backward, ids without the eoi token: RuntimeError: {str(exc).splitlines()[0][:90]}")
    dist.destroy_process_group()


def main() -> None:
    from transformers import T5Gemma2Config, T5Gemma2ForConditionalGeneration

    text = dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0, bos_token_id=2,
                eos_token_id=1, layer_types=["sliding_attention", "full_attention"])
    vision = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=16)
    config = T5Gemma2Config(encoder=dict(text_config=text, vision_config=vision, mm_tokens_per_image=4),
                            decoder=text, eoi_token_index=EOI)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        model = T5Gemma2ForConditionalGeneration(config)
        with torch.no_grad():  # drawn, not transformers' zeros: a zero vector written anywhere changes nothing
            model.model.encoder.text_model.embed_tokens.eoi_embedding.normal_()
        model.save_pretrained(folder)
        mp.spawn(rank, args=(folder,), nprocs=WORLD)


if __name__ == "__main__":
    main()
