"""transformers 5.25.0: T5Gemma's and T5Gemma2's classification heads raise on `use_cache=False`.

    python docs/upstream/transformers_t5gemma_cls_use_cache.py

One process, no download, no parallelism. Each class's forward calls its base model with `use_cache=False` and
also passes the caller's `**kwargs` on, so a caller's own `use_cache` reaches the call twice. Prints each class
and what a forward with and without `use_cache=False` did.
"""

import torch
import transformers

SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=2, head_dim=16)


def tiny(name):
    config = getattr(transformers, name)()
    for half in ("encoder", "decoder"):
        part = getattr(config, half)
        part = getattr(part, "text_config", None) or part  # T5Gemma2 nests the text sizes one level deeper
        for key, value in SMALL.items():
            setattr(part, key, value)
        if getattr(part, "cross_attention_hidden_size", None):  # the decoder attends to the encoder's width
            part.cross_attention_hidden_size = SMALL["hidden_size"]
    config.num_labels = 2
    return config


def main():
    torch.manual_seed(0)
    ids = torch.randint(2, 100, (1, 6))
    for family in ("T5Gemma", "T5Gemma2"):
        for head in ("ForSequenceClassification", "ForTokenClassification"):
            model = getattr(transformers, family + head)(tiny(family + "Config")).eval()
            model(input_ids=ids)
            try:
                model(input_ids=ids, use_cache=False)
                print(family + head, "use_cache=False: runs")
            except TypeError as exc:
                text = str(exc)  # it quotes the whole base model's repr first
                print(family + head, "use_cache=False: TypeError:", text[text.find("got multiple"):])


if __name__ == "__main__":
    main()
