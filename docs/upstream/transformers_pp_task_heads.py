"""transformers 5.25.0: `DistributedConfig(pp_size=...)` takes only causal-LM heads on a text-only base model.

    python docs/upstream/transformers_pp_task_heads.py     # 2 ranks, gloo, CPU; a tiny random Llama, Llava, T5Gemma

Three classes whose configs carry a `base_model_pp_plan` (their own, their text config's, or their encoder's and
decoder's) load with pp_size=2 and cannot run:

- `LlamaForSequenceClassification`: the last stage broadcasts the model's logits to every stage assuming a
  causal LM's (batch, seq_len, vocab) (`PipelineStage.broadcast_from_last`); a sequence head's logits are
  (batch, labels), so the forward raises AssertionError on the last stage (rank 1 prints it; rank 0, waiting in the broadcast,
  then loses its peer and the spawn ends with gloo's error).
- `LlavaForConditionalGeneration`: `apply_pipeline_parallelism` splits `base_model.layers`; a vision-language
  model's base model (`LlavaModel`) keeps its layers under `language_model`, so loading raises AttributeError.
- `T5GemmaForConditionalGeneration`: the same, for an encoder-decoder: `T5GemmaModel` keeps its layers under
  `encoder` and `decoder` (each with a pp plan of its own), none under `layers`.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def build(folder: str) -> None:
    from transformers import CLIPVisionConfig, LlamaConfig, LlamaForSequenceClassification, LlavaConfig
    from transformers import LlavaForConditionalGeneration

    text = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, pad_token_id=0, num_labels=3)
    torch.manual_seed(0)
    LlamaForSequenceClassification(text).save_pretrained(os.path.join(folder, "seq-cls"))
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                              image_size=8, patch_size=4)
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_id=127, image_seq_length=4)
    LlavaForConditionalGeneration(config).save_pretrained(os.path.join(folder, "llava"))
    from transformers import T5GemmaConfig, T5GemmaForConditionalGeneration

    half = dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, head_dim=32, pad_token_id=0, bos_token_id=2, eos_token_id=1)
    T5GemmaForConditionalGeneration(T5GemmaConfig(encoder=half, decoder=half)).save_pretrained(
        os.path.join(folder, "t5gemma"))


def attempt(what: str, fn) -> str:
    try:
        fn()
        return f"{what}: ran"
    except (AssertionError, AttributeError) as exc:
        return f"{what}: {type(exc).__name__}: {str(exc).splitlines()[0][:90]}"


def rank(r: int, folder: str) -> None:
    os.environ.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), WORLD), rank=r,
                            world_size=WORLD)
    from transformers import LlamaForSequenceClassification, LlavaForConditionalGeneration
    from transformers import T5GemmaForConditionalGeneration
    from transformers.distributed import DistributedConfig

    staged = DistributedConfig(pp_size=WORLD)
    ids = torch.randint(1, 127, (2, 8), generator=torch.Generator().manual_seed(7))
    model = LlamaForSequenceClassification.from_pretrained(os.path.join(folder, "seq-cls"), distributed_config=staged)
    lines = [attempt("sequence classification forward", lambda: model(input_ids=ids))]
    lines.append(attempt("llava load", lambda: LlavaForConditionalGeneration.from_pretrained(
        os.path.join(folder, "llava"), distributed_config=staged)))
    lines.append(attempt("t5gemma load", lambda: T5GemmaForConditionalGeneration.from_pretrained(
        os.path.join(folder, "t5gemma"), distributed_config=staged)))
    print(f"rank {r}: " + "; ".join(lines), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as folder:
        build(folder)
        mp.spawn(rank, args=(folder,), nprocs=WORLD)
