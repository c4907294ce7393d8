"""The multimodal-LM mapping (`AutoModelForMultimodalLM`): which task runs each of its classes, and why the kit runs
none of the rest.

It is no task of its own: for every model type with a TP plan but two (transformers 5.25.0: 96 of the 98 of its
119 with a plan), the class it names is also the class another task's mapping names for that model type (the
image-text-to-text class, the causal LM, the seq2seq LM or the audio-text class, whose mappings include the speech
seq2seq one), so the sweep already runs that class, under that task, with that task's inputs (and refusals: an
image-text family without an image builder stays refused there). The two whose class no task names (thinker-talker
wrappers) are refused here by name. Torch-free at import.
"""

from __future__ import annotations

from paracheck.adapters.transformers import tasks

MAPPING = "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES"

#: model type -> why no task runs its multimodal class.
REFUSED = {
    "qwen2_5_omni": "the thinker-talker wrapper, whose talker and token2wav turn the text into speech, which the kit "
                    "does not check; its text-and-image model is the image-text family qwen2_5_omni_thinker",
    "qwen3_omni_moe": "the thinker-talker wrapper, whose talker and code2wav turn the text into speech, which the kit "
                      "does not check; its text-and-image model is the image-text family qwen3_omni_moe_thinker",
}


def classes() -> dict[str, str]:
    """model type -> the class the mapping names (the first, where it names several)."""
    from transformers.models.auto import modeling_auto

    return {k: v if isinstance(v, str) else v[0] for k, v in (getattr(modeling_auto, MAPPING, None) or {}).items()}


def coverage() -> dict[str, str]:
    """model type -> the key of the task that runs its multimodal class (`image-text`, `causal-lm`, `seq2seq`,
    `audio-text`: the first in `tasks.TASKS` whose mapping names the same class; the sweep then runs it where its
    config has a TP plan), or `refused: WHY` for a class no task names whose config has a TP plan (one without a plan is left
    out, as the sweep leaves it). One that neither a task runs nor `REFUSED` names is `unknown`: a transformers
    release that adds one, which the kit's test catches. Only those few configs are built."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from paracheck.adapters.transformers.sweep import planned

    found = {}
    for model_type, name in sorted(classes().items()):
        task = next((t for t in tasks.TASKS if tasks.classes(t).get(model_type) == name), None)
        if task is not None:
            found[model_type] = task.key
        elif model_type in CONFIG_MAPPING and planned(CONFIG_MAPPING[model_type], tasks.IMAGE_TEXT):
            found[model_type] = f"refused: {REFUSED[model_type]}" if model_type in REFUSED else "unknown"
    return found
