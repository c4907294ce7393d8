"""The model tasks the transformers adapter runs: for each, the auto mapping its classes come from, the labels (and,
through `images`, the pixels) its batch carries, how its loss adds up over data-parallel shards, and whether it
generates.

A checkpoint names its own class (`config.architectures`): a rank loads exactly the class the launcher built or the
user wrote (`load`), and reads its task from the mapping that holds the class (`of_model`). The bundled fixtures and
every earlier sweep family are causal LMs, whose names and batches stay as they were. Torch-free at import.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from paracheck.adapters.transformers.fixtures import VARIANTS
from paracheck.adapters.transformers.refused import Refused


@dataclass(frozen=True)
class Task:
    name: str  # the support matrix's task column
    key: str  # how `--models transformers:all-KEY` selects the task's families
    #: Appended to a family's name in the sweep (`llama-seq-cls`): transformers' model types never hold a hyphen
    #: followed by these, and causal LMs keep their bare names, so earlier reports and replays still match.
    suffix: str
    mapping: str  # its name in `transformers.models.auto.modeling_auto`
    auto: str  # the auto class that builds a config's model for this task
    generates: bool
    #: The head's loss is each shard's mean (it takes no `num_items_in_batch`): the data-parallel shards' losses
    #: average to the global one, and FSDP's averaged gradients are already the global ones.
    shard_mean: bool
    variants: tuple[str, ...]
    #: Of the seq2seq mapping, which classes the task takes: its encoder-decoders (True) or the rest, an audio
    #: encoder in front of a causal LM (False); None for a mapping one task takes whole.
    encoder_decoder: bool | None = None
    #: Further (mapping, auto class) pairs whose classes the task also takes where `mapping` does not name the model
    #: type (the same `encoder_decoder` rule applies), each built by its own auto class (`auto_class`).
    more: tuple[tuple[str, str], ...] = ()


CAUSAL_LM = Task("causal LM", "causal-lm", "", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM", True, False,
                 VARIANTS)
# Padding only where each shard's mean still averages to the global mean: a sequence label per row is never
# padded away; a token label is, so token classification takes unpadded rows.
SEQUENCE_CLASSIFICATION = Task("sequence classification", "seq-cls", "-seq-cls", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
                               "AutoModelForSequenceClassification", False, True, VARIANTS)
TOKEN_CLASSIFICATION = Task("token classification", "token-cls", "-token-cls", "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
                            "AutoModelForTokenClassification", False, True, ("base", "packed", "embeds"))
# No embeds variant: a vision-language model finds its image placeholders in `input_ids`.
IMAGE_TEXT = Task("image-text-to-text", "image-text", "-image-text", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
                  "AutoModelForImageTextToText", True, False, ("base", "left_pad", "right_pad", "packed"))
# An encoder-decoder: the token rows feed the encoder, a target of its own (`TARGET` tokens) the decoder. Its loss is
# the decoder's token mean like a causal LM's (it takes `num_items_in_batch`), over every label, none shifted away
# (the decoder's inputs are the labels shifted right). Padding only on the encoder's rows: no packed documents
# (a bidirectional encoder has no block-diagonal mask of packed rows), no embeds.
SEQ2SEQ = Task("seq2seq LM", "seq2seq", "-seq2seq", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
               "AutoModelForSeq2SeqLM", True, False, ("base", "left_pad", "right_pad"), encoder_decoder=True)
# The seq2seq mapping's other classes: an audio encoder in front of a causal LM (speech recognition, audio
# understanding), whose clip's features replace placeholder tokens (`audio`). Its loss is a causal LM's (labels
# shifted, `num_items_in_batch`), -100 on the placeholders. No packed documents (one clip a row, at its first
# token), no embeds (the placeholders are found in `input_ids`).
# The speech seq2seq mapping holds two more such classes that the seq2seq mapping does not (fun_asr_nano, vibevoice).
AUDIO_TEXT = Task("audio-text-to-text", "audio-text", "-audio-text", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
                  "AutoModelForSeq2SeqLM", True, False, ("base", "left_pad", "right_pad"), encoder_decoder=False,
                  more=(("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "AutoModelForSpeechSeq2Seq"),))
TASKS = (CAUSAL_LM, SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION, IMAGE_TEXT, SEQ2SEQ, AUDIO_TEXT)
#: Labels a classification head tells apart in the kit's configs (transformers' default is 2).
NUM_LABELS = 3
#: A seq2seq target's tokens: fewer than the encoder's rows, so a decoder length taken for the encoder's shows;
#: a padded variant's second row ends in `TARGET_PAD` labels -100 (a collator pads targets on the right).
TARGET = 8
TARGET_PAD = 3


class NotEncoderDecoder(Refused):
    """A config the seq2seq task is asked to run that is no encoder-decoder (an audio encoder in front of a causal
    LM: the audio-text task's, `AUDIO_TEXT`); the message adds the sub-configs in front of its LM."""

    WHY = ("not an encoder-decoder (an audio or other encoder in front of a causal LM): the audio-text task runs "
           "it (-audio-text); the seq2seq task runs encoder-decoders (t5gemma, t5gemma2)")

    def __init__(self, model_type: str, fed: str):
        super().__init__(model_type, self.WHY, fed)


def by_suffix(name: str) -> tuple[str, Task]:
    """A sweep family's name split into (model type, task): `llama-seq-cls` -> ("llama", sequence
    classification); a bare name is a causal LM."""
    for task in TASKS:
        if task.suffix and name.endswith(task.suffix):
            return name[:-len(task.suffix)], task
    return name, CAUSAL_LM


@functools.lru_cache(maxsize=None)
def classes(task: Task) -> dict[str, str]:
    """model type -> the class name the task's auto mappings give it (the first mapping that names the type; its
    first class, where it names several); of the seq2seq mappings, the encoder-decoders or the rest
    (`Task.encoder_decoder`, read on the config class, which declares it: no config is built)."""
    return {k: name for k, (name, _) in _held(task).items()}


def auto_class(task: Task, model_type: str) -> str:
    """The auto class that builds `model_type`'s model for `task`: that of the mapping that names it (the task's
    own for a type none names)."""
    return _held(task).get(model_type, ("", task.auto))[1]


@functools.lru_cache(maxsize=None)
def _held(task: Task) -> dict[str, tuple[str, str]]:
    from transformers.models.auto import modeling_auto
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    held: dict[str, tuple[str, str]] = {}
    for mapping_name, auto in ((task.mapping, task.auto),) + task.more:
        mapping = getattr(modeling_auto, mapping_name, None) or {}
        for k, v in mapping.items():
            if task.encoder_decoder is not None and (k not in CONFIG_MAPPING or bool(
                    getattr(CONFIG_MAPPING[k], "is_encoder_decoder", False)) != task.encoder_decoder):
                continue
            held.setdefault(k, (v if isinstance(v, str) else v[0], auto))
    return held


def _owner(class_name: str) -> Task | None:
    return next((t for t in TASKS if class_name in classes(t).values()), None)


def of_class_name(name: str) -> Task:
    """The task whose mapping holds class `name` (the first in `TASKS`); a class no mapping names (a user's own) is
    taken as a causal LM, which is what the adapter ran before it knew tasks."""
    return _owner(name) or CAUSAL_LM


def of_model(model) -> Task:
    """The task of a built model: its class's, or that of the first of its bases a mapping names."""
    return next((task for klass in type(model).__mro__ if (task := _owner(klass.__name__))), CAUSAL_LM)


def of_case(model: str, built) -> Task:
    """A case's task: the one its name carries (a sweep family's suffix), else its built model's class's (`of_model`).
    The name decides first because 7 classes sit in two mappings (Gemma3ForConditionalGeneration is the causal LM
    and the image-text-to-text class of gemma3)."""
    name, task = by_suffix(model)
    return task if name != model else of_model(built)


def model_class(path: str, config=None):
    """The class the checkpoint at `path` was saved from (`config.architectures`), where transformers has it;
    else `AutoModelForCausalLM` (a checkpoint that names no class, or one of the user's own)."""
    import transformers

    if config is None:
        config = transformers.AutoConfig.from_pretrained(path)
    name = (getattr(config, "architectures", None) or [""])[0]
    return getattr(transformers, name, None) or transformers.AutoModelForCausalLM


def load(path: str, **kwargs):
    """`from_pretrained` of the checkpoint's own class (`model_class`), given the checkpoint's own config class
    (`AutoConfig`), as an Auto class gives it. A class several model types share (Param2MoE's and SarvamMoE's
    `Glm4MoeForCausalLM`) would otherwise read the config as its own type (transformers warns it is "not
    supported"), and its `save_pretrained` would label the original-format weights with that type, whose reload
    skips the checkpoint's conversion and leaves the renamed tensors newly initialized. Every model loaded here
    gets its family's image door (`images.doored`), so the reference and the parallel model take the same batch."""
    import transformers

    from paracheck.adapters.transformers import images

    config = transformers.AutoConfig.from_pretrained(path)
    loaded = model_class(path, config).from_pretrained(path, config=config, **kwargs)
    images.doored(loaded[0] if isinstance(loaded, tuple) else loaded)  # (model, info) with output_loading_info
    return loaded


def prepared(config, task: Task):
    """`config` made ready for the task's inputs (a copy): a classifier's label count and padding token (a
    sequence head pools each row's last unpadded token, which it finds by the padding id); a vision-language
    model's image sizes and placeholder token (`images.prepared`), an audio model's clip and placeholder token
    (`audio.prepared`); every dropout 0 (`_no_dropout`). `refused.NoBuilder` names a family
    whose image or audio inputs the kit cannot make."""
    import copy

    from paracheck.adapters.transformers import audio, images
    from paracheck.adapters.transformers.inputs import PAD_ID

    config = copy.deepcopy(config)
    if task.shard_mean:
        config.num_labels = NUM_LABELS
        config.pad_token_id = PAD_ID
        text = getattr(config, "text_config", None)
        if text is not None:
            text.pad_token_id = PAD_ID
    if task is IMAGE_TEXT:
        config = images.prepared(config)
    if task is SEQ2SEQ:
        _encoder_decoder(config)
    if task is AUDIO_TEXT:
        config = audio.prepared(config)
    _no_dropout(config)
    return config


#: What a config's name for a random drop ends or holds: dropout probabilities, GPT-style `*_pdrop`, stochastic depth
#: (`drop_path_rate`) and layer-drop (`encoder_layerdrop`), each drawn per process in train mode.
_DROPS = ("dropout", "pdrop", "drop_path", "layerdrop")


def _no_dropout(config) -> None:
    """Every random drop of `config` and of its sub-configs at every depth 0 (`_DROPS`), a classifier head's too
    (`classifier_dropout`, which `GenericForTokenClassification` takes as 0.1 where the config names none).
    parity.steps trains in train mode, where a drop draws from each process's own random stream: no parallel step
    could equal the single-process one (measured: llama-token-cls fsdp2 parted at step 1 by 1.99e-2 on
    `score.weight`; qianfan_ocr's vision tower defaults `drop_path_rate` to 0.1)."""
    seen, parts = set(), [config]
    while parts:
        part = parts.pop()
        if part is None or id(part) in seen:
            continue
        seen.add(id(part))
        for name, value in list(vars(part).items()):
            if any(d in name for d in _DROPS) and isinstance(value, float):
                setattr(part, name, 0.0)
        parts += [getattr(part, key, None) for key in getattr(part, "sub_configs", {}) or {}]
    config.classifier_dropout = 0.0  # the head's, read from the config it is built with


def refuse(config, task: Task) -> None:
    """Raise the task's `Refused` where the kit makes no inputs for `config` (no image or audio builder; a seq2seq
    class that is no encoder-decoder), touching nothing: the sweep asks before fitting."""
    from paracheck.adapters.transformers import audio, images

    if task is IMAGE_TEXT:
        images.builder(config)
    if task is AUDIO_TEXT:
        audio.builder(config)
    if task is SEQ2SEQ and not getattr(config, "is_encoder_decoder", False):
        fed = sorted(k for k in vars(config) if k.endswith("_config") and k != "text_config")
        raise NotEncoderDecoder(config.model_type, f"{', '.join(fed) or 'no encoder'} in front of its LM")


def _encoder_decoder(config) -> None:
    """The seq2seq task's check on a config (`refuse`), and the padding id its decoder's inputs take where a label
    is -100 (as the kit's prompts and targets pad)."""
    from paracheck.adapters.transformers.inputs import PAD_ID

    refuse(config, SEQ2SEQ)
    config.pad_token_id = PAD_ID
    for key in ("encoder", "decoder", "text_config"):
        part = getattr(config, key, None)
        if part is not None and hasattr(part, "pad_token_id"):
            part.pad_token_id = PAD_ID


def with_labels(task: Task, batch: dict, config, seed: int) -> dict:
    """The batch of token rows (`inputs`) made the task's: image placeholders and pixels for a vision-language
    model, audio placeholders and mel features for an audio one (labels -100 on the placeholders), a class per row
    or per unpadded token for a classifier."""
    import torch

    from paracheck.adapters.transformers import audio, images

    if task is IMAGE_TEXT:
        return images.with_images(batch, config, seed)
    if task is AUDIO_TEXT:
        return audio.with_audio(batch, config, seed)
    if task is SEQ2SEQ:
        return with_target(batch, config, seed)
    if not task.shard_mean:
        return batch
    generator = torch.Generator().manual_seed(seed + 1)
    labels = batch["labels"]
    if task is SEQUENCE_CLASSIFICATION:
        return dict(batch, labels=torch.randint(0, NUM_LABELS, (labels.shape[0],), generator=generator))
    drawn = torch.randint(0, NUM_LABELS, labels.shape, generator=generator)
    return dict(batch, labels=drawn.masked_fill(labels == -100, -100))


def with_target(batch: dict, config, seed: int) -> dict:
    """A seq2seq batch: the token rows (and their mask) for the encoder, `TARGET` random labels per row for the
    decoder (where the rows pad, every second row's last `TARGET_PAD` are -100), and `decoder_input_ids`: the
    labels shifted right behind the decoder's start token, -100 read as padding, as the model's own
    `prepare_decoder_input_ids_from_labels` makes them (given here so a pass without labels, no_grad inference,
    has the decoder's inputs too; with labels the model takes them instead of shifting its own)."""
    import torch

    rows = batch["input_ids"].shape[0]
    vocab = config.get_text_config(decoder=True).vocab_size
    labels = torch.randint(1, vocab, (rows, TARGET), generator=torch.Generator().manual_seed(seed + 2))
    if "attention_mask" in batch:
        labels[1::2, TARGET - TARGET_PAD:] = -100
    out = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}
    return dict(out, labels=labels, decoder_input_ids=shifted_right(labels, config))


def shifted_right(labels, config):
    """The decoder's inputs for `labels`: each row shifted right by one behind the decoder's start token (its
    `bos_token_id`), -100 replaced by its padding id."""
    decoder = config.get_text_config(decoder=True)
    shifted = labels.new_full(labels.shape, decoder.bos_token_id)
    shifted[:, 1:] = labels[:, :-1]
    return shifted.masked_fill(shifted == -100, decoder.pad_token_id)


def shard_mean(task: Task, model) -> bool:
    """Whether `model`'s loss is each data shard's mean (the shards' losses average to the global one): the task's
    heads' (`Task.shard_mean`), or an audio class whose own loss is a plain mean (`own_mean_loss`)."""
    return task.shard_mean or (task is AUDIO_TEXT and own_mean_loss(model))


#: torch's losses whose default reduction is the mean, as a class of its own builds them (UltraVBert's head,
#: Qwen2-Audio's and Granite Speech's `nn.CrossEntropyLoss()`).
_MEAN_LOSSES = re.compile(r"\b(?:CrossEntropyLoss|MSELoss|BCEWithLogitsLoss)\(\)")


def own_mean_loss(model) -> bool:
    """Whether `model`'s own `forward` (an FSDP wrapper's is its class's) takes its loss as one of torch's
    default-mean losses and never reads `num_items_in_batch`, or calls the library's classification loss without
    handing it the Trainer's count (`_counts_nothing`): a plain mean over its own tokens or rows. Read from the source
    once per function."""
    forward = type(model).forward
    # As the library's `loss_function` reads it: the config's, the model's, else derived from the class name.
    loss_type = (getattr(getattr(model, "config", None), "loss_type", None) or getattr(model, "loss_type", None)
                 or type(model).__name__)
    return _reads_own_mean(forward) or (any(t in loss_type for t in _CLASSIFICATION_LOSSES) and _counts_nothing(forward))


#: The `loss_type`s whose library loss (`self.loss_function`) is a mean over the rows or tokens unless it is handed
#: `num_items_in_batch`.
_CLASSIFICATION_LOSSES = ("ForSequenceClassification", "ForTokenClassification")
_LOSS_CALLS = re.compile(r"self\.loss_function\(([^()]*(?:\([^()]*\)[^()]*)*)\)")


def _counts_nothing(forward) -> bool:
    """Whether every `self.loss_function(...)` call in `forward` passes neither `num_items_in_batch` nor `**` keyword
    arguments (GPT-NeoX's sequence head and the generic classification heads: `self.loss_function(logits=...,
    labels=..., pooled_logits=..., config=...)`). A call nested two parentheses deep is not read: with no call read,
    the answer is no (not this cause, as far as the kit can tell)."""
    calls = _LOSS_CALLS.findall(_source(forward))
    return bool(calls) and all("**" not in call and "num_items_in_batch" not in call for call in calls)


def _reads_own_mean(forward) -> bool:
    source = _source(forward)
    return bool(_MEAN_LOSSES.search(source)) and "num_items_in_batch" not in source


@functools.lru_cache(maxsize=None)
def _source(forward) -> str:
    """`forward`'s source, read once; "" where there is none to read (then no cause is read from it)."""
    import inspect

    try:
        return inspect.getsource(forward)
    except (OSError, TypeError):
        return ""


def variants(task: Task, model) -> tuple[str, ...]:
    """The variants `model` takes: its task's, but the padded ones where its loss is a shard mean the task's others
    do not take (`shard_mean`): padded rows give the shards unequal token counts, whose means do not average to the
    global mean (the classification heads' tasks leave them out whole)."""
    if task is AUDIO_TEXT and shard_mean(task, model):
        return tuple(v for v in task.variants if not v.endswith("_pad"))
    return task.variants


def loss_kwargs(task: Task, labels) -> dict:
    """What the training forward takes besides the batch: the global count of predicted tokens where the task's
    loss divides by it (the shards' losses then add up to the global mean), nothing where it is a shard mean. A
    seq2seq loss predicts every label (its decoder's inputs are already shifted), a causal LM's all but each
    row's first."""
    from paracheck.adapters.transformers.inputs import predicted_tokens

    if task.shard_mean:
        return {}
    return {"num_items_in_batch": int((labels != -100).sum()) if task is SEQ2SEQ else predicted_tokens(labels)}
