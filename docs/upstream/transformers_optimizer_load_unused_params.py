"""transformers 5.25.0: `load_optimizer_distributed` cannot load what `save_optimizer_distributed` saved from an
optimizer that has stepped a model with a parameter no loss reaches (Llava's last vision layer).

    python docs/upstream/transformers_optimizer_load_unused_params.py    # 2 gloo ranks, CPU; a tiny random Llava

Llava takes its image features from the vision tower's second-to-last layer (`vision_feature_layer = -2`), so the
last layer's weights never get a gradient, and AdamW keeps no state for them. `save_optimizer_distributed` saves
the state the optimizer has; `load_optimizer_distributed` builds the state dict to load into from the destination
optimizer with torch's `get_optimizer_state_dict`, which, on an optimizer that has not stepped, first takes a zero
step over every parameter (`_init_optim_state`), so the destination asks for the last layer's state too, and
`dcp.load`'s default planner raises on the key the checkpoint lacks. The script takes one AdamW step on a model
loaded with `DistributedConfig(tp_size=2)`, saves the model and optimizer, loads both back on the same layout and
prints what the optimizer load raises (CLIP's `post_layernorm` is never reached either); then the same with its
text model alone, a Llama whose every parameter gets a gradient, which loads.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
IMAGE = 127  # the placeholder id: the text vocabulary's last


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, IMAGE, (2, 12), generator=g)
    ids[:, :4] = IMAGE  # 8 x 8 pixels in 4 x 4 patches: 4 image features a row
    return {"input_ids": ids, "pixel_values": torch.randn(2, 3, 8, 8, generator=g),
            "labels": torch.where(ids == IMAGE, -100, ids)}


def resume(folder: str, auto, inputs: dict) -> str:
    """One step, the library's distributed save of model and optimizer, both loaded back: what the load raised."""
    from transformers.distributed import DistributedConfig
    from transformers.distributed.checkpoint import load_optimizer_distributed, save_optimizer_distributed

    tp = DistributedConfig(tp_size=WORLD)
    model = auto.from_pretrained(folder, distributed_config=tp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(**inputs).loss.backward()
    optimizer.step()
    unused = [n for n, p in model.named_parameters() if p not in optimizer.state]
    saved = os.path.join(folder, "resume")
    model.save_pretrained(os.path.join(saved, "model"), distributed_checkpoint=True)
    save_optimizer_distributed(model, optimizer, os.path.join(saved, "optimizer"))
    model = auto.from_pretrained(os.path.join(saved, "model"), distributed_config=tp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    try:
        load_optimizer_distributed(model, optimizer, os.path.join(saved, "optimizer"))
        outcome = "loaded"
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        missing = [line for line in str(exc).splitlines() if line.startswith("RuntimeError: Missing key")]
        outcome = f"raised {type(exc).__name__}: {missing[0] if missing else str(exc)[:200]}"
        if missing:
            key = missing[0].split("optimizer.state.")[1].rsplit(".", 2)[0]
            outcome += f" (a parameter without AdamW state: {key in unused})"
    return f"{len(unused)} parameters without AdamW state {unused[:2]}: {outcome}"


def rank(r: int, root: str) -> None:
    os.environ.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(root, "store"), WORLD), rank=r,
                            world_size=WORLD)
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    text = {k: v for k, v in batch().items() if k != "pixel_values"}
    for name, auto, inputs in (("llava", AutoModelForImageTextToText, batch()), ("llama", AutoModelForCausalLM, text)):
        outcome = resume(os.path.join(root, name), auto, inputs)
        if r == 0:
            print(f"{name} tp{WORLD}: {outcome}")
        dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    from transformers import (CLIPVisionConfig, LlamaConfig, LlamaForCausalLM, LlavaConfig,
                              LlavaForConditionalGeneration)
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as root:
        torch.manual_seed(0)
        text = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4)
        config = LlavaConfig(vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                            num_attention_heads=4, image_size=8, patch_size=4),
                             text_config=text, image_token_index=IMAGE)
        LlavaForConditionalGeneration(config).save_pretrained(os.path.join(root, "llava"))
        LlamaForCausalLM(text).save_pretrained(os.path.join(root, "llama"))
        mp.spawn(rank, args=(root,), nprocs=WORLD)


if __name__ == "__main__":
    main()
