"""transformers 5.25.0: `generate` on a vision-language model sharded with FSDP raises on its first step.

    python docs/upstream/transformers_fsdp_vlm_generate.py     # 2 ranks, gloo, CPU; a tiny random Llava

`GenerationMixin` encodes the images before the first decode step by calling `self.base_model.get_image_features`
directly (`_prepare_multimodal_encoder_outputs`, generation/utils.py), outside the model's `forward`. FSDP2
gathers the parameters its root group owns (the vision tower's patch embedding among them) in the root module's
pre-forward hook, which that call never enters: the convolution meets its still-sharded DTensor weight beside
plain pixels and raises. It works only while the root's group happens to be gathered: after a forward (the root
is not resharded after its forward) and before a backward reshards it. `generate` on one process runs.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def build(folder: str) -> None:
    from transformers import LlamaConfig, CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    text = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                              image_size=8, patch_size=4)
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_id=127, image_seq_length=4)
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(folder)


def inputs():
    ids = torch.randint(1, 127, (2, 8), generator=torch.Generator().manual_seed(7))
    ids[:, :4] = 127  # one image: 4 placeholders (2 x 2 patches)
    pixels = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(8))
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels)


def attempt(model, args: dict) -> str:
    try:
        model.generate(**inputs(), **args)
        return "generates"
    except RuntimeError as exc:
        return f"RuntimeError: {str(exc).splitlines()[0][:90]}"


def rank(r: int, folder: str) -> None:
    os.environ.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), WORLD), rank=r,
                            world_size=WORLD)
    from transformers import LlavaForConditionalGeneration
    from transformers.distributed import DistributedConfig

    args = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    single = LlavaForConditionalGeneration.from_pretrained(folder)
    sharded = LlavaForConditionalGeneration.from_pretrained(folder, distributed_config=DistributedConfig(
        fsdp_size=WORLD))
    with torch.no_grad():
        single.generate(**inputs(), **args)
        outcomes = [attempt(sharded, args)]  # freshly loaded: every group sharded
        sharded(**inputs())  # the root keeps its group gathered after a forward (reshard_after_forward=False)
        outcomes.append(attempt(sharded, args))
    print(f"rank {r}: one process generates; FSDP, first: {outcomes[0]}; after a forward: {outcomes[1]}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as folder:
        build(folder)
        mp.spawn(rank, args=(folder,), nprocs=WORLD)
