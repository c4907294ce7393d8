"""The bundled tiny transformers causal LMs: their configs, factories and input space, and the checkpoint each
case loads.

The index (`FIXTURES`, `MOE`, `VARIANTS`, `SPACE`) and the factories are torch-free so the CLI can list and
select the fixtures, and explore draw their shapes, before any rank starts. `save` builds a model from its
config with a fixed seed and writes it with `save_pretrained`, once per run directory, as a user's
checkpoint would be; ranks then load it with `from_pretrained`. No hub access.
"""

from __future__ import annotations

import os
import shutil

from paracheck.adapters.transformers import LIBRARY
from paracheck.domain.shapes import TOKENS, Axis, Space

#: fixture name -> (config class name, config fields). Sizes are the smallest that 4-way TP, FSDP and EP
#: still split on every planned dimension: 4 query and 4 key/value heads, vocab and widths divisible by 4; 4 layers,
#: so 4 pipeline stages each own one.
_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=4, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False)
CONFIGS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(_COMMON)),
    "qwen3": ("Qwen3Config", dict(_COMMON)),
    # A window shorter than the inputs (12 tokens), so the sliding mask matters.
    "mistral": ("MistralConfig", dict(_COMMON, sliding_window=4)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(_COMMON, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                          decoder_sparse_step=1, mlp_only_layers=[])),
    # Sliding and full layers mixed.
    "gemma3": ("Gemma3TextConfig", dict(_COMMON, tie_word_embeddings=True, sliding_window=4, layer_types=["sliding_attention",
                                        "full_attention", "sliding_attention", "full_attention"])),
}
FIXTURES = tuple(CONFIGS)
#: Fixtures with an expert plan (EP layouts apply).
MOE = ("qwen3_moe",)
#: Input variants every fixture takes: batch 2 plain; sample 1 padded on the left or the right (attention_mask);
#: packed sequences (position_ids restarting, no mask); inputs_embeds instead of input_ids.
VARIANTS = ("base", "left_pad", "right_pad", "packed", "embeds")
SEED = 0
#: The inputs every fixture takes (what explore draws): rows of 2 to `max_position_embeddings` tokens, 12 in the
#: named variants; up to 4 rows, so a 4-way data-parallel layout gets one each; padded on either side, or packed.
SPACE = Space({TOKENS: Axis(12, 12, 2, 64)}, masks=True, timesteps=False, batch=4, token_rows=True)


def _factory(name: str):
    """Fixture `name` as a `--spec`-style factory: `(variant, shape) -> (fixture name, shape)`. The rank loads
    the named fixture's checkpoint and feeds the shape's rows (None: the variant's own batch)."""

    def factory(variant: str = "base", shape=None):
        return name, shape

    factory.__name__ = factory.__qualname__ = name
    factory.library, factory.space, factory.variants = LIBRARY, SPACE, VARIANTS
    return factory


# The factories `cases.factory_of(name)` names, one per fixture (a found case's spec calls them).
llama, qwen3, mistral, qwen3_moe, gemma3 = (_factory(name) for name in ("llama", "qwen3", "mistral", "qwen3_moe",
                                                                        "gemma3"))


def config(name: str):
    """The fixture's transformers config (eager attention is never forced: sdpa, the default, runs)."""
    import transformers

    if name not in CONFIGS:
        raise ValueError(f"fixture {name!r}: transformers fixtures are {', '.join(FIXTURES)}")
    class_name, fields = CONFIGS[name]
    return getattr(transformers, class_name)(**fields)


def write(model, path: str) -> None:
    """`model.save_pretrained(path)` without transformers' "Writing model shards" bar: the host writes checkpoints
    between its own progress lines (a sweep's one per family), and the bar's carriage returns garble them."""
    from transformers.utils import logging

    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        model.save_pretrained(path)
    finally:
        if shown:
            logging.enable_progress_bar()


def save(name: str, folder: str) -> str:
    """Write fixture `name` into `folder/<name>` with `save_pretrained` (unless it is there); returns the path.
    Deterministic: a fixed seed on CPU, so every process that builds it writes the same weights."""
    import torch
    from transformers import AutoModelForCausalLM

    path = os.path.join(folder, f"transformers-{name}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(config(name), dtype=torch.float32)
    tmp = f"{path}.tmp{os.getpid()}"
    write(model, tmp)
    try:
        os.rename(tmp, path)  # atomic: a reader sees no checkpoint or a whole one
    except OSError:  # another process wrote it first: same weights
        shutil.rmtree(tmp, ignore_errors=True)
    return path
