"""transformers 5.24.0: Llama4ForConditionalGeneration's forward reads an `image_outputs` field its language model
does not return, so every call that returns a dict raises.

    python docs/upstream/transformers_llama4_image_outputs.py     # one process, CPU; a tiny random Llama4

`Llama4ForConditionalGeneration.forward` builds its output from `self.language_model(...)`, a
`Llama4ForCausalLM` whose output has no `image_outputs`, then reads `outputs.image_outputs`: AttributeError on
one process, with or without pixels, so no parallel layout can run either. 5.25.0 reads it no more.
"""

import torch
import transformers
from transformers import Llama4Config, Llama4ForConditionalGeneration


def main() -> None:
    text = dict(vocab_size=128, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=16,
                  patch_size=8, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    torch.manual_seed(0)
    model = Llama4ForConditionalGeneration(Llama4Config(text_config=text, vision_config=vision)).eval()
    ids = torch.randint(0, 128, (1, 8))
    try:
        with torch.no_grad():
            out = model(input_ids=ids)
        print(f"transformers {transformers.__version__}: forward returns logits {tuple(out.logits.shape)}")
    except AttributeError as exc:
        print(f"transformers {transformers.__version__}: forward raises AttributeError: {exc}")


if __name__ == "__main__":
    main()
