"""transformers 5.25.0: HunYuan-VL numbers each image over the whole batch in its M-RoPE's image axis, so a row's
logits depend on the rows batched before it.

    python docs/upstream/transformers_hunyuan_vl_batch_image_index.py    # one process, CPU; a tiny random HunYuanVL

`HunYuanVLModel.get_rope_index` gives every image token the image's ordinal as its last rotary axis
("the ordinal of the image/frame in the input sequence"), but its counter starts once for the batch, not for each
row: the second row's first image is ordinal 1 in a batch of two and 0 alone. The script runs two rows with one
image each, batched and one at a time, and prints the largest logit difference, each row's image axis both ways,
and the batch run again with each row's ordinals counted from 0 (the positions passed in): equal to the rows alone.
"""

import torch


def main() -> None:
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.utils import logging

    logging.set_verbosity_error()
    config = AutoConfig.for_model("hunyuan_vl")
    text, vision = config.text_config, config.vision_config
    for part in (text, vision):
        part.hidden_size = part.intermediate_size = 32
        part.num_hidden_layers, part.num_attention_heads, part.num_key_value_heads = 2, 2, 2
    text.vocab_size, text.head_dim, text.max_position_embeddings = 128, 16, 64
    text.rope_parameters = dict(text.rope_parameters, mrope_section=[4, 2, 2])  # (width, height, image ordinal)
    vision.text_hidden_size, config.image_token_id = 32, 127
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).eval()
    with torch.no_grad():  # its begin/end/newline features start empty: draw them, as training would have
        for name, param in model.named_parameters():
            if "image_" in name:
                param.normal_(0, 0.02)

    # An image of 2 x 2 patches merged into 1 x 1: its begin, one feature, the row's newline, its end.
    patches = vision.num_channels * vision.patch_size ** 2
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 127, (2, 12), generator=g)
    ids[:, 2:6] = 127
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "mm_token_type_ids": (ids == 127).long(), "pixel_values": torch.randn(2 * 4, patches, generator=g),
             "image_grid_thw": torch.tensor([[1, 2, 2]] * 2)}
    rows = [{"input_ids": ids[r:r + 1], "attention_mask": batch["attention_mask"][r:r + 1],
             "mm_token_type_ids": batch["mm_token_type_ids"][r:r + 1],
             "pixel_values": batch["pixel_values"][4 * r:4 * r + 4], "image_grid_thw": batch["image_grid_thw"][r:r + 1]}
            for r in range(2)]

    def positions(b):
        return model.model.get_rope_index(b["input_ids"], b["mm_token_type_ids"], b["image_grid_thw"],
                                          b["attention_mask"])[0]

    with torch.no_grad():
        alone = torch.cat([model(**row).logits for row in rows])
        batched = model(**batch).logits
        per_row = positions(batch).clone()
        per_row[-1] = torch.cat([positions(row)[-1] for row in rows])
        counted_per_row = model(**batch, position_ids=per_row).logits
    print(f"max |batched - each row alone| logits: {float((batched - alone).abs().max()):.2e} "
          f"(row 0 {float((batched[0] - alone[0]).abs().max()):.2e}, row 1 {float((batched[1] - alone[1]).abs().max()):.2e})")
    print(f"row 1's image axis batched: {positions(batch)[-1, 1].tolist()}")
    print(f"row 1's image axis alone:   {positions(rows[1])[-1, 0].tolist()}")
    print(f"max |batched with per-row image ordinals - each row alone|: "
          f"{float((counted_per_row - alone).abs().max()):.2e}")


if __name__ == "__main__":
    main()
