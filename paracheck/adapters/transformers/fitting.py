"""Fitting a transformers config (a causal LM's, or a composite model's with its sub-configs) to a layout: which
sizes each degree splits, the rules they must keep, a fitted tiny config or a refusal naming the size, the degree
and the rule.

Torch-free at import and pure: it reads and builds `PretrainedConfig`s, never a model. A size is found by the
config key that holds it (the config's own key, never an `attribute_map` alias), by role:

- heads (`num_attention_heads`, `num_key_value_heads`, `n_head`, `linear_num_value_heads`, `mamba_n_heads`, ...):
  split by tp, so tp must divide each;
- widths (every `*intermediate_size`, `*ffn_hidden_size`, per layer where a list): split by tp (colwise then
  rowwise), so tp must divide each. In a model with an expert plan each width's tp shard must also be a
  multiple of `16 // itemsize` elements (4 in fp32, 8 in bf16), and so must `hidden_size`: the experts'
  grouped matmul (`torch.nn.functional.grouped_mm`, reached from transformers' `integrations.moe._grouped_mm`)
  refuses operands whose strides are not multiples of 16 bytes ("strides should be multiple of 16 bytes").
  Measured on torch 2.13 CPU: the forward needs the contraction dimension aligned (a down projection's
  contraction is the expert width's shard), the backward the output dimension too; any other size runs;
- vocabulary (`vocab_size`): split by tp where the TP plan splits the embedding or the head;
- layers (`num_hidden_layers`, `n_layer`, `num_layers`; in a config with none of these keys, the per-layer list
  whose length it reads as its layer count, NemotronH's `layers_block_type`: `_layer_list`): split by pp, at least
  one per stage;
- experts (`num_experts`, `num_local_experts`, `n_routed_experts`, `moe_num_experts`): split by ep;
- batch (an input, not a config size): split by the data-parallel degree dpr x fsdp (`batch_misfits`).

`misfits` checks a config as it is (the mixins, on the user's own config: a layout that does not fit is
skipped before any rank starts); `fit` raises every size to the smallest value that keeps the rules (the
sweep over every family's tiny config), keeping `hidden_size = heads x head_dim` where the config derives
`head_dim`, and lengthening per-layer lists with the layer count. `tiny` shrinks a config class's defaults.

A composite config (a vision-language, audio or seq2seq model's) is fitted part by part: `parts` walks its
nested sub-configs with the degrees whose plans reach each (a sub-config's own `base_model_*_plan`, as
transformers applies them), and `misfits`, `refusal` and `fit` name a nested size by its key path
(`text_config.num_attention_heads`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from paracheck.domain.records import Failure, FailureKind

HEADS, WIDTH, VOCAB, LAYERS, EXPERTS, HIDDEN = "heads", "width", "vocabulary", "layers", "experts", "hidden"

_ROLES = (
    (HEADS, re.compile(r"^(?:\w+_)?(?:n|num)(?:_\w+)?_heads$|^n_head$")),
    (WIDTH, re.compile(r"^(?:\w+_)?(?:intermediate_size|ffn_hidden_size)(?:_\w+)?$")),
    (VOCAB, re.compile(r"^vocab_size$")),
    (LAYERS, re.compile(r"^(?:num_hidden_layers|n_layer|num_layers)$")),
    (EXPERTS, re.compile(r"^(?:num_experts|num_local_experts|n_routed_experts|moe_num_experts)$")),
    (HIDDEN, re.compile(r"^(?:hidden_size|n_embd|d_model)$")),
)
#: Keys a role's pattern matches that hold no split size (a grouping knob, not a count of heads or widths).
_NOT_SIZES = frozenset({"heads_per_ngram", "num_heads_per_ngram"})
#: Degree each role is split by, and the rule's words.
_RULES = {HEADS: ("tp", "tp must divide each head count (heads are split across the TP ranks)"),
          WIDTH: ("tp", "tp must divide each intermediate width (colwise then rowwise across the TP ranks)"),
          VOCAB: ("tp", "tp must divide the vocabulary (the embedding and the head are split by rows)"),
          LAYERS: ("pp", "every pipeline stage needs at least one layer (layers >= pp)"),
          EXPERTS: ("ep", "ep must divide the expert count (each EP rank holds an equal share)")}
#: Bytes the experts' grouped matmul wants each operand stride to be a multiple of.
GROUPED_MM_BYTES = 16
VOCAB_KEY = "vocab_size"
ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}
#: The plan each degree needs on the config.
_PLANS = {"tp": "base_model_tp_plan", "ep": "base_model_ep_plan", "pp": "base_model_pp_plan"}


@dataclass(frozen=True)
class Need:
    """The degrees a layout splits sizes by, and the dtype's bytes per element."""
    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int = 1
    itemsize: int = 4

    @classmethod
    def of(cls, layout, dtype: str = "fp32") -> "Need":
        return cls(layout.tp, layout.pp, layout.ep, layout.dp, ITEMSIZE[dtype])

    @classmethod
    def world(cls, world: int, dtype: str = "fp32") -> "Need":
        """What every layout of `world` ranks needs at once: one fitted config serves them all."""
        return cls(world, world, world, world, ITEMSIZE[dtype])

    @property
    def align(self) -> int:
        """Elements per 16 bytes: what the experts' grouped matmul wants each dimension a multiple of."""
        return GROUPED_MM_BYTES // self.itemsize


@dataclass(frozen=True)
class Misfit:
    """One size a layout cannot take: its key, value, the degree that splits it and the rule it breaks."""
    key: str
    value: int
    degree: str
    size: int
    rule: str

    def sentence(self) -> str:
        return f"{self.key}={self.value} does not fit {self.degree}={self.size}: {self.rule}"


class Unfittable(Exception):
    """The config cannot take the layout; the message says why (the report's skip reason). `misfits` are the
    sizes that broke a rule; `missing_plan` names a plan the config lacks altogether."""

    def __init__(self, message: str, misfits: tuple = (), missing_plan: str = ""):
        super().__init__(message)
        self.misfits, self.missing_plan = tuple(misfits), missing_plan

    @property
    def failure(self) -> Failure:
        return Failure(FailureKind.SKIP, missing_plan=self.missing_plan)


@dataclass
class Fit:
    config: object
    changes: list[str] = field(default_factory=list)


def sizes(config) -> dict[str, list[str]]:
    """role -> the config's own keys holding a size of that role (an int, or a list of ints per layer)."""
    found: dict[str, list[str]] = {}
    for key, value in _fields(config).items():
        if key in _NOT_SIZES or not _is_size(value):
            continue
        for role, pattern in _ROLES:
            if pattern.match(key):
                found.setdefault(role, []).append(key)
                break
    return found


def plan_problems(config, need: Need) -> str | None:
    """Why the config's plans cannot take `need` at all (the plan it lacks on the config and on its
    `text_config`, where a vision-language model keeps its language plans), else None."""
    for degree, plan in _PLANS.items():
        if getattr(need, degree) > 1 and not has_plan(config, degree):
            return plan
    return None


#: Sub-configs whose plans stand for the model's: a vision-language model's language model, an encoder-decoder's
#: two halves (T5Gemma keeps its plans on `encoder` and `decoder`, each built as a model of its own).
_PLANNED_PARTS = ("text_config", "encoder", "decoder")


def has_plan(config, degree: str) -> bool:
    """Whether `config`, its `text_config` or an encoder-decoder's `encoder` or `decoder` carries the plan
    `degree` ("tp", "ep", "pp") needs: where `plan_problems` looks."""
    plan = _PLANS[degree]
    return any(getattr(part, plan, None) for part in [config] + [getattr(config, k, None) for k in _PLANNED_PARTS])


def parts(config, need: Need, world: Need | None = None) -> list[tuple[str, object, Need]]:
    """(key path, config, the degrees that reach it) for `config` ("" its path, every degree of `need`) and each
    sub-config nested in it at any depth (`text_config`, `vision_config`, `audio_config`, a projector's, ...).
    A degree reaches a sub-config as transformers 5.25 applies plans (`DistributedMixin.init_parallel_plans`):
    each sub-model built from a sub-config takes its own config's `base_model_*_plan`, and a parent merges its
    children's plans under their module names; so a sub-config is split by the plans it has itself, and by
    tp where its parent's TP plan names its module (`_reaches`). A sub-config no plan reaches is replicated.
    `world` is the layout's degrees: a plan of its own reaches a sub-config under a parent that has none
    (T5Gemma2's encoder text config, under an encoder config with no plan)."""
    world = world or need
    out = [("", config, need)]
    for key in _nested(config):
        out += [(f"{key}.{path}" if path else key, c, n)
                for path, c, n in parts(getattr(config, key), _sub_need(config, key, need, world), world)]
    return out


def _sub_need(config, key: str, need: Need, world: Need) -> Need:
    """The degrees of the layout (`world`) that reach `config`'s sub-config `key` (1 for those that do not)."""
    sub = getattr(config, key)
    reach = {d: getattr(world, d) if getattr(sub, plan, None) else 1 for d, plan in _PLANS.items()}
    if _reaches(getattr(config, "base_model_tp_plan", None), key):
        reach["tp"] = need.tp
    return Need(reach["tp"], reach["pp"], reach["ep"], 1, need.itemsize)


def _reaches(plan, key: str) -> bool:
    """Whether a parent's TP plan names the module built from its sub-config `key` (`text_config` builds the
    `language_model`, `vision_config` the `vision_tower` or `vision_model`, ...)."""
    stem = key.removesuffix("_config")
    modules = {f"{stem}_model", f"{stem}_tower", f"{stem}_encoder"} | ({"language_model"} if stem == "text" else set())
    return any(name.removeprefix("model.").split(".")[0] in modules for name in plan or {})


def misfits(config, need: Need) -> list[Misfit]:
    """Every size of `config` and of its nested sub-configs that `need` splits and cannot take as it is, a nested
    one named by its key path (`text_config.num_attention_heads`); empty when the layout fits."""
    out = []
    for path, part, part_need in parts(config, need):
        out += [Misfit(f"{path}.{m.key}" if path else m.key, m.value, m.degree, m.size, m.rule)
                for m in _own_misfits(part, part_need)]
    return out


def _own_misfits(config, need: Need) -> list[Misfit]:
    """`misfits` for the config's own keys (its sub-configs left out)."""
    found = sizes(config)
    moe = bool(getattr(config, "base_model_ep_plan", None))
    out = []
    for role, (degree, rule) in _RULES.items():
        d = getattr(need, degree)
        if d == 1 and not (role == WIDTH and moe):
            continue
        for key in found.get(role, []):
            for value in _values(getattr(config, key)):
                if role == LAYERS and value < d:
                    out.append(Misfit(key, value, degree, d, rule))
                elif role != LAYERS and value % d:
                    out.append(Misfit(key, value, degree, d, rule))
                elif role == WIDTH and moe and (value // d) % need.align:
                    out.append(Misfit(key, value, "tp", need.tp, _align_rule(need)))
    if moe:
        for key in found.get(HIDDEN, []):
            if getattr(config, key) % need.align:
                out.append(Misfit(key, getattr(config, key), "dtype bytes", need.itemsize, _align_rule(need)))
    listed = _layer_list(config, found)
    if listed and len(getattr(config, listed)) < need.pp:
        out.append(Misfit(listed, len(getattr(config, listed)), "pp", need.pp, _RULES[LAYERS][1]))
    return out


def refusal(config, need: Need) -> str | None:
    """The skip sentence for running `config` on `need` as it is, or None when it fits."""
    plan = plan_problems(config, need)
    if plan:
        return f"{type(config).__name__} has no {plan}"
    bad = misfits(config, need)
    return "; ".join(m.sentence() for m in bad) or None


def batch_misfit(batch: int, need: Need) -> Misfit | None:
    if batch % need.dp:
        return Misfit("batch", batch, "dpr x fsdp", need.dp, "the data-parallel degree must divide the batch")
    return None


def fit(config, need: Need) -> Fit:
    """A copy of `config` whose sizes, and those of its sub-configs the layout reaches (`parts`), keep every rule
    of `need`, each raised to the smallest value that does; Unfittable names the plan it lacks, or the sizes no
    change of the config could make fit (a nested one by its key path)."""
    plan = plan_problems(config, need)
    if plan:
        raise Unfittable(f"{type(config).__name__} has no {plan}, so it cannot take that parallelism",
                         missing_plan=plan)
    fitted, changes = _fit_part(config, need)
    left = misfits(fitted, need)
    if left:
        raise Unfittable("; ".join(m.sentence() for m in left), misfits=left)
    return Fit(fitted, changes)


def _fit_part(config, need: Need, path: str = "", world: Need | None = None) -> tuple[object, list[str]]:
    """`config` fitted to `need`, its sub-configs first (each to the degrees that reach it: `parts`), and the
    changes made ("text_config.num_attention_heads 2->4")."""
    world = world or need
    values = _fields(config)
    notes = []
    for key in _nested(config):
        sub, sub_notes = _fit_part(getattr(config, key), _sub_need(config, key, need, world), f"{path}{key}.", world)
        if sub_notes:  # a dict, which the config class builds its sub-config from
            values[key], notes = sub.to_dict(), notes + sub_notes
    notes += [f"{path}{note}" for note in _follow_hidden(_fields(config), values)]
    found = sizes(config)
    moe = bool(getattr(config, "base_model_ep_plan", None))
    if path and (need.tp, need.pp, need.ep) == (1, 1, 1) and not moe:  # no plan splits it: left as it is
        return (_build(config, values) if notes else config), notes
    changes: dict = {}
    _fit_heads(values, found, need, changes)
    for key in found.get(WIDTH, []):
        step = need.tp * (need.align if moe else 1)
        changes[key] = _each(values[key], lambda v: _up(v, step))
    if need.tp > 1:
        for key in found.get(VOCAB, []):
            changes[key] = _up(values[key], need.tp)
    for key in found.get(EXPERTS, []):
        changes[key] = _up(values[key], need.ep)
    for key in found.get(LAYERS, []):
        changes[key] = max(values[key], need.pp)
    _fit_tied(values, changes)
    changes = {k: v for k, v in changes.items() if v != values[k]}
    _fit_layer_lists(values, found, changes)
    listed = _layer_list(config, found)
    if listed and len(values[listed]) < need.pp:  # the list is the layer count: lengthened to a layer per stage
        _resize_layer_lists(values, len(values[listed]), need.pp, changes)
    fitted = _build(config, {**values, **changes})
    return fitted, [f"{path}{k} {_short(values.get(k))}->{_short(v)}" for k, v in changes.items()] + notes


def _fit_heads(values: dict, found: dict, need: Need, changes: dict) -> None:
    """Heads up to a multiple of tp, query heads a multiple of key/value heads, hidden = heads x head_dim
    where the config derives head_dim from them (and aligned for the experts where it has them)."""
    heads = found.get(HEADS, [])
    for key in heads:
        changes[key] = _up(values[key], need.tp)
    q = next((k for k in ("num_attention_heads", "n_head") if k in heads), None)
    kv = "num_key_value_heads" if "num_key_value_heads" in heads else None
    if q and kv and changes[kv]:  # a multiple of the key/value heads, as many times over as the config's were
        changes[q] = max(_up(changes[q], changes[kv]), changes[kv] * (values[q] // max(values[kv], 1)))
    hidden = next(iter(found.get(HIDDEN, [])), None)
    if q and hidden and not values.get("head_dim") and values[q]:
        head_dim = values[hidden] // values[q]
        changes[hidden] = changes[q] * head_dim


def _fit_layer_lists(values: dict, found: dict, changes: dict) -> None:
    """Per-layer lists (layer_types, layers_block_type, per-layer widths) cut or lengthened with the layer
    count: every kind of layer the list has is kept first, then its pattern repeats, so the config still
    describes every layer and still has each kind. Per-layer dicts keyed by layer index keep the indices
    that remain."""
    layers_key = next(iter(found.get(LAYERS, [])), None)
    if layers_key in changes:
        _resize_layer_lists(values, values[layers_key], changes[layers_key], changes)


def _resize_layer_lists(values: dict, old: int, new: int, changes: dict) -> None:
    """`_fit_layer_lists` from `old` layers to `new`: each list of `old` entries, each dict keyed by layer index."""
    for key, value in values.items():
        value = changes.get(key, value)
        if key.endswith(("_token_id", "_token_ids")) or key in ("id2label", "label2id"):
            continue  # a list of token ids is not one entry per layer, nor are the labels keyed by class index
        if isinstance(value, list) and len(value) == old and old > 0:
            changes[key] = per_layer(value, new)
        elif isinstance(value, dict) and value and all(str(k).isdigit() for k in value) and new < old:
            changes[key] = {k: v for k, v in value.items() if int(k) < new}


def _layer_list(config, found: dict) -> str | None:
    """The per-layer list that alone counts `config`'s layers, or None: where the config has no layer-count key
    (`LAYERS`) and reads its layer count (`num_hidden_layers`) as the length of a list of its own (NemotronH's
    property over `layers_block_type`, at any depth: NeMo SpeechLM's text model), that list is its depth, so the
    tiny rule cuts it and a pipeline lengthens it as they change a layer-count key."""
    if found.get(LAYERS):
        return None
    try:
        count = getattr(config, "num_hidden_layers", None)
    except Exception:  # a config whose derived count does not resolve: nothing counts its layers
        return None
    if not _is_int(count) or count <= 0:
        return None
    # Layer kinds, by name: a list of numbers as long as the count is something else (ConvNext's widths per stage,
    # SegFormer's depths, PP-OCR's kernel sizes).
    return next((k for k, v in _fields(config).items() if isinstance(v, list) and len(v) == count
                 and all(isinstance(item, str) for item in v)), None)


def per_layer(value: list, new: int) -> list:
    """A per-layer list cut or lengthened to `new` layers: where cut, every kind it has first (so the config still
    has each kind), then its pattern repeats."""
    old = len(value)
    head = list(dict.fromkeys(value)) if new < old and _hashable(value) else []
    return (head + [value[i % old] for i in range(new)])[:new]


def _hashable(items: list) -> bool:
    return all(isinstance(v, (str, int, float, type(None))) for v in items)


def _fit_tied(values: dict, changes: dict) -> None:
    """Sizes a config requires to equal a product of others: the Mamba mixers' heads x head dim = their
    inner width (`mamba_d_ssm`, else `mamba_expand x hidden_size`), as bamba, falcon_h1 and granitemoehybrid
    validate."""
    merged = {**values, **changes}
    if "mamba_d_head" in merged and merged.get("mamba_n_heads"):
        inner = merged.get("mamba_d_ssm") or merged.get("mamba_expand", 2) * merged["hidden_size"]
        if inner % merged["mamba_n_heads"] == 0:
            changes["mamba_d_head"] = inner // merged["mamba_n_heads"]


def tiny(config_class, **overrides):
    """`config_class`'s defaults shrunk to a tiny model: hidden 64, 2 query and key/value heads of 16, widths
    32, 4 experts (2 per token), vocabulary 128, 2 layers (a layer of each kind, at most 4, whatever key counts
    them, `depth` or `encoder_layers` too: `_cut_depth`), 64 positions. Sizes the class does not have are
    left out; what the class derives from them, it derives itself. Nested sub-configs (a multimodal family's
    vision or audio encoder, a vision-language model's text config), at any depth, are shrunk by the same rule:
    the model builds them whole even for text inputs."""
    try:
        default = config_class()
    except Exception as exc:  # a config class whose own defaults its validators reject
        raise Unfittable(f"{config_class.__name__} rejects its own defaults: {exc}".splitlines()[0]) from exc
    return _build(default, {**_shrunk_tree(default), **overrides})


def _shrunk_tree(default) -> dict:
    """`_shrunk` of the config, each sub-config in it shrunk the same way (a dict, which the config class builds
    its sub-config from)."""
    values = {**_shrunk(default), **{key: _shrunk_tree(getattr(default, key)) for key in _nested(default)}}
    _follow_hidden(_fields(default), values)
    return values


#: Sizes a composite config may require to equal another sub-config's hidden size.
_HIDDEN_TIE = re.compile(r"^(?:\w+_)?hidden_size$")


def _follow_hidden(before: dict, after: dict) -> list[str]:
    """Sub-config sizes a composite config validates against another sub-config's `hidden_size` (a vision or
    audio encoder's `out_hidden_size` or `text_hidden_size`, an adaptor's `hidden_size`, all checked against
    `text_config.hidden_size`; a diarization head's `audio_hidden_size` against its encoder's): each `*hidden_size`
    whose value in `before` equals an anchor's (a sub-config with heads of its own, `text_config` first) takes
    the anchor's value in `after` (an adaptor's own `hidden_size` too: FunAsrNano's has heads). Returns the changes
    made, by key path."""
    subs = [k for k, v in before.items() if isinstance(v, dict) and "model_type" in v]
    anchors = sorted((k for k in subs if _is_int(before[k].get("hidden_size")) and _has_heads(before[k])),
                     key=lambda k: k != "text_config")
    done, notes = set(), []
    for anchor in anchors:
        old, new = before[anchor]["hidden_size"], after[anchor]["hidden_size"]
        for key in subs:
            for name, value in before[key].items():
                if key == anchor or (key, name) in done or not _HIDDEN_TIE.match(name) or value != old:
                    continue
                done.add((key, name))
                if after[key][name] != new:
                    notes.append(f"{key}.{name} {after[key][name]}->{new}")
                    after[key][name] = new
    for (key, name), (anchor, divisor) in _QUOTIENTS.get(before.get("model_type"), {}).items():
        if key in subs and anchor in subs and after[key].get(name) != after[anchor]["hidden_size"] // divisor:
            notes.append(f"{key}.{name} {after[key].get(name)}->{after[anchor]['hidden_size'] // divisor}")
            after[key][name] = after[anchor]["hidden_size"] // divisor
    return notes


#: Sizes a composite config validates as a quotient of another sub-config's `hidden_size`, which no default's
#: equality shows: model type -> {(sub-config, key): (anchor sub-config, divisor)}. FunAsrNano's adaptor widens
#: to a quarter of the text width (its `validate_architecture`).
_QUOTIENTS = {"fun_asr_nano": {("adaptor_config", "intermediate_size"): ("text_config", 4)}}


def _has_heads(values: dict) -> bool:
    return any(_ROLES[0][1].match(k) and _is_size(v) and k not in _NOT_SIZES for k, v in values.items())


def keeps_sizes_nested(config) -> list[str]:
    """The sub-config keys of a config that keeps its sizes in them (no head count of its own), else []."""
    nested = _nested(config)
    return nested if nested and not sizes(config).get(HEADS) else []


def _nested(config) -> list[str]:
    """The keys of `config` holding a sub-config."""
    return [k for k, v in vars(config).items() if hasattr(v, "to_dict") and hasattr(v, "model_type")]


def _shrunk(default) -> dict:
    """One config's own keys and values with the tiny rule applied (its sub-configs left as they are)."""
    defaults, found = _fields(default), sizes(default)
    values = _role_sizes(defaults, found)
    _cap_others(defaults, values, next(iter(found.get(HIDDEN, [])), None))
    if defaults.get("enable_moe_block") is False and getattr(type(default), "base_model_ep_plan", None):
        # A family with an expert plan whose defaults leave its MoE block off (gemma4): on, so the plan has experts.
        values.update({"enable_moe_block": True, **{k: v for k, v in _MOE_UNSET.items() if defaults.get(k, 0) is None}})
    for key, small_value in _UNSET.items():
        if key in defaults and defaults[key] is None:
            values[key] = small_value
    _cut_depths(default, defaults, found, values)
    _fit_tied(defaults, values)
    _settle(defaults, values)
    return {**defaults, **values}


#: The tiny size of each role.
_SMALL = {HEADS: 2, WIDTH: 32, VOCAB: 128, LAYERS: 2, EXPERTS: 4, HIDDEN: 64}


def _role_sizes(defaults: dict, found: dict) -> dict:
    """Each size `found` by role, cut to its role's tiny size; the hidden size 16 per query head where the config
    derives its head dim from it."""
    values = {key: _each(defaults[key], lambda v, r=role: min(v, _SMALL[r]) if v else v)
              for role, keys in found.items() for key in keys}
    hidden = next(iter(found.get(HIDDEN, [])), None)
    q = next((k for k in ("num_attention_heads", "n_head") if k in found.get(HEADS, [])), None)
    if hidden and q and defaults.get("head_dim") is None:
        values[hidden] = values[q] * 16
    return values


def _cap_others(defaults: dict, values: dict, hidden: str | None) -> None:
    """Sizes no role names, each cut to a tiny value of its own (head dims, positions, top-k, groups, ...)."""
    for key, value in defaults.items():
        if not _is_int(value):
            continue
        if key.endswith("head_dim") and value > 16:
            values[key] = 16
        elif key in ("max_position_embeddings", "n_positions") and value > 64:
            values[key] = 64
        elif key in ("num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk") and value > 2:
            values[key] = 2
        elif key in ("n_group", "topk_group", "num_expert_group") and value > 1:
            values[key] = 1
        elif "vocab_size" in key and key != VOCAB_KEY and value > 128:  # per-layer-input vocabularies (gemma4)
            values[key] = 128
        elif key == "hidden_size_per_layer_input" and value > 16:
            values[key] = 16
        elif key.endswith("lora_rank") and value > 16:
            values[key] = 16
        elif key.endswith("shared_experts") and value > 1:
            values[key] = 1
        elif _OTHER_EXPERTS.match(key) and value > _SMALL[EXPERTS]:
            # Experts of another kind in the same pool (longcat_flash's 256 identity experts next to 512 routed
            # ones): kept beside the 4 routed ones, or nearly every token would route to them and leave the routed
            # experts without a gradient on some ranks.
            values[key] = _SMALL[EXPERTS]
        elif "channel" in key and value == defaults.get(hidden) and hidden in values:
            # A convolution's channels that the defaults make as wide as the hidden state: they stay as wide.
            values[key] = values[hidden]
        elif key == "num_kv_shared_layers" and value > 0:
            # Layers reusing an earlier layer's keys and values (gemma3n): with the layers cut to a few, the
            # earlier layers would not hold every kind the sharing ones read, which the config refuses.
            values[key] = 0


def _cut_depths(default, defaults: dict, found: dict, values: dict) -> None:
    """The layer count (its key, or the per-layer list that alone counts the layers) and every other depth
    (`_OTHER_DEPTHS`) cut to the tiny depth, with the lists that go by layer."""
    layers_key = next(iter(found.get(LAYERS, [])), None)
    listed = _layer_list(default, found)
    depths = [(layers_key, defaults[layers_key])] if layers_key else [(None, len(defaults[listed]))] if listed else []
    depths += [(k, v) for k, v in defaults.items() if _OTHER_DEPTHS.match(k) and _is_int(v) and v > _SMALL[LAYERS]]
    for key, old in depths:
        _cut_depth(defaults, key, old, values, _SMALL[LAYERS])


def _settle(defaults: dict, values: dict) -> None:
    """What the cut sizes make invalid, put right: token ids past the vocabulary, rotary widths past the head,
    sizes derived from others, the mrope sections, an unresolved key-value head count; the embeddings untied."""
    for key, value in defaults.items():
        if key.endswith("_token_id") and _is_int(value) and value >= values.get(VOCAB_KEY, value + 1):
            values[key] = values[VOCAB_KEY] - 1  # an embedding's padding index must lie in the vocabulary
    head_dim = values.get("head_dim") or 16
    for key in ("rotary_dim", "rotary_emb_base_dim"):  # a rotary width wider than the shrunk head (codegen, gptj)
        if _is_int(defaults.get(key)) and defaults[key] > head_dim:
            values[key] = head_dim // 2
    _keep_derived(defaults, values)
    _shrink_mrope(defaults, values)
    if defaults.get("num_key_value_heads", 0) is None and "num_attention_heads" in values:
        values["num_key_value_heads"] = values["num_attention_heads"]  # a model may read it unresolved (nemotron)
    if "tie_word_embeddings" in defaults:
        values["tie_word_embeddings"] = False


#: Layer counts by other names, which the tiny rule cuts as it cuts `LAYERS` (no plan splits them by pp): a vision
#: tower's `depth` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V, Ernie 4.5 VL), an audio encoder's `encoder_layers`
#: (Qwen2-Audio, Qwen2.5-Omni, Qwen3-ASR), Inkling's vision `n_layers`, Gemma3n's audio `conf_num_hidden_layers`,
#: phi4 audio's `num_blocks`; an encoder-decoder's `encoder_layers` and `decoder_layers`.
_OTHER_DEPTHS = re.compile(r"^(?:depth|n_layers|num_blocks|encoder_layers|decoder_layers|conf_num_hidden_layers)$")
#: Lists naming some layers of a stack by index (Qwen2.5-VL's `fullatt_block_indexes`, full-attention blocks among
#: windowed ones; Qwen3-VL's `deepstack_visual_indexes`, the blocks a deepstack merger taps; SAM's
#: `global_attn_indexes`; Mllama's `intermediate_layers_indices`). A backbone's `out_indices` name its stages,
#: counted from the embeddings, not its layers: left as they are.
_LAYER_INDEXES = re.compile(r"^(?!\w*out_ind)\w+_ind(?:exes|ices)$")


def _cut_depth(defaults: dict, key: str | None, old: int, values: dict, small: int) -> None:
    """A layer count (`key`; None where a per-layer list alone counts the layers) cut from `old` to a layer of each
    kind its per-layer lists and index lists name (at most 4), at least `small`; its per-layer lists cut with it
    (`per_layer`: every kind first), and its index lists remapped to the cut stack (`_layer_kinds`)."""
    indexed, kinds = _layer_kinds(defaults, old)
    count = max([len(set(v)) for v in defaults.values() if isinstance(v, list) and _hashable(v)
                 and len(v) == old] + [len(set(kinds)), small])
    new = min(old, max(small, min(count, 4)))
    if key:
        values[key] = new
    _resize_layer_lists(defaults, old, new, values)
    cut = per_layer(kinds, new)
    for bit, name in enumerate(indexed):
        # Each index list keeps its kind of layer once (the blocks it names keep their place among the others: a
        # full-attention block after a windowed one), so one deepstack tap, one merger: the text model adds the
        # i-th merger's output to its i-th layer, and more taps than text layers would leave mergers unused.
        values[name] = [i for i, kind in enumerate(cut) if kind >> bit & 1]


def _layer_kinds(defaults: dict, old: int) -> tuple[list[str], list[int]]:
    """The index lists over a stack of `old` layers (`_LAYER_INDEXES`: distinct indexes, each below `old`), and each
    layer's kind: a bit for each list naming it."""
    indexed = [k for k, v in defaults.items() if _LAYER_INDEXES.match(k) and isinstance(v, list) and v
               and all(_is_int(i) and 0 <= i < old for i in v) and len(set(v)) == len(v)]
    return indexed, [sum(1 << bit for bit, k in enumerate(indexed) if i in defaults[k]) for i in range(old)]


def _keep_derived(defaults: dict, values: dict) -> None:
    """Sizes the shrunk ones must still relate to as the defaults' do: query heads at least twice the key/value
    heads where the defaults have them so (mimo_v2_flash doubles its key/value heads on sliding layers), the
    query/key head width the sum of its two parts (the latent-attention families: longcat_flash; mistral4 calls it
    head_dim), and the Mamba
    mixers' groups no more than their heads (nemotron_h divides one by the other)."""
    q, kv = defaults.get("num_attention_heads"), defaults.get("num_key_value_heads")
    if _is_int(q) and _is_int(kv) and kv and q // kv >= 2 and "num_key_value_heads" in values:
        values["num_attention_heads"] = max(values.get("num_attention_heads", q), 2 * values["num_key_value_heads"])
    parts = [values.get(k, defaults.get(k)) for k in ("qk_nope_head_dim", "qk_rope_head_dim")]
    if _is_int(defaults.get("qk_head_dim")) and all(_is_int(p) for p in parts):
        values["qk_head_dim"] = sum(parts)
    was = [defaults.get(k) for k in ("qk_nope_head_dim", "qk_rope_head_dim")]
    if all(_is_int(p) for p in parts + was) and defaults.get("head_dim") == sum(was) and "head_dim" in values:
        values["head_dim"] = sum(parts)  # mistral4: its rotary takes head_dim x partial_rotary_factor = the rope part
    heads = values.get("mamba_num_heads", defaults.get("mamba_num_heads"))
    if _is_int(defaults.get("n_groups")) and _is_int(heads) and defaults["n_groups"] > heads:
        values["n_groups"] = heads


def _shrink_mrope(defaults: dict, values: dict) -> None:
    """A multimodal rotary split (`rope_parameters.mrope_section`: time, height, width) scaled to the shrunk
    rotary half width, as the config requires its sections to sum to it (cosmos3_edge: `head_dim // 2`,
    hy_v4_vl: `qk_rope_head_dim // 2`); each section keeps its share, the remainder going to the largest."""
    rope = defaults.get("rope_parameters")
    sections = rope.get("mrope_section") if isinstance(rope, dict) else None
    if not (isinstance(sections, list) and sections and all(_is_int(v) and v > 0 for v in sections)):
        return
    key = next((k for k in ("qk_rope_head_dim", "head_dim") if _is_int(defaults.get(k))
                and defaults[k] // 2 == sum(sections) and _is_int(values.get(k))), None)
    if key is None or values[key] // 2 < len(sections):
        return
    total, old = values[key] // 2, sum(sections)
    new = [v * total // old for v in sections]
    for i in sorted(range(len(new)), key=lambda i: -(sections[i] * total % old))[:total - sum(new)]:
        new[i] += 1
    values["rope_parameters"] = {**rope, "mrope_section": new}


#: Counts of experts besides the routed pool's own count (`zero_expert_num`): shrunk to the same tiny count.
_OTHER_EXPERTS = re.compile(r"^(?:\w+_)?expert_num$|^(?:num|n)_\w+_experts$")


#: Sizes a config class's defaults may leave unset (None) although its model reads them with no fallback
#: (ministral and hunyuan read `head_dim`, dots1 its expert counts, deepseek_v2 its top-k and groups): the tiny model's value for each.
_UNSET = {"head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1,
          "topk_group": 1}


#: The sizes of a MoE block the defaults leave unset while it is off.
_MOE_UNSET = {"num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32}


def _align_rule(need: Need) -> str:
    return (f"the experts' grouped matmul wants every dimension a multiple of {GROUPED_MM_BYTES} bytes, "
            f"{need.align} elements of {need.itemsize} bytes (each expert width's tp shard and hidden_size)")


def _fields(config) -> dict:
    """The config's own keys and values (no alias, no nested config)."""
    out = config.to_dict()
    out.pop("transformers_version", None)
    return out


def _build(config, values: dict):
    """The config class built from `values`; Unfittable in transformers' words where it rejects them."""
    values = {k: v for k, v in values.items() if k not in ("model_type", "architectures")}
    try:
        return type(config)(**values)
    except Exception as exc:  # huggingface_hub's strict validators raise their own Exception subclass
        first = str(exc).strip().splitlines()[-1].strip()
        raise Unfittable(f"{type(config).__name__} rejects the fitted sizes: {first}") from exc


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_size(value) -> bool:
    return (_is_int(value) and value > 0) or (isinstance(value, list) and bool(value)
                                              and all(_is_int(v) and v > 0 for v in value))


def _values(value) -> list[int]:
    return list(value) if isinstance(value, list) else [value]


def _each(value, fn):
    return [fn(v) for v in value] if isinstance(value, list) else fn(value)


def _up(value: int, multiple: int) -> int:
    return multiple * math.ceil(value / multiple) if multiple > 1 else value


def _short(value) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."
