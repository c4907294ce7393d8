"""Negative controls for the transformers adapter: each planted bug, where it applies, what must catch it.

They are the kit's `Control` records (judged by `Control.judge`, like the diffusers ones); how each is
planted lives in `PLANTS`, read by `rank`. A bug is planted the way a user or a release could make it: a plan
override passed in `DistributedConfig`, a data-parallel switch left off, a wrong loss factor. No module
outside this one names these controls.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from paracheck.adapters.transformers import checkpoint_plants
from paracheck.domain.adapter import Refused
from paracheck.domain.control import PLANTED, Control, applicable_to
from paracheck.domain.records import CheckId


@dataclass(frozen=True)
class Plant:
    #: Rules merged into `DistributedConfig(tp_plan=...)`, keys with the full `model.` prefix.
    tp_plan: dict = field(default_factory=dict)
    #: Plan keys the model's own tp_plan must have for the bug to exist (else the case is skipped).
    needs_rules: tuple = ()
    #: (model, layout) -> None, after `from_pretrained` built the parallel model; or the module it planted in,
    #: for a control whose place only the case knows (`Control.plants_in` "{planted}").
    after_load: Callable | None = None
    #: The factor the local loss is multiplied by before backward, given the layout's dp. The right one is dp
    #: itself (FSDP2 averages gradients over the dp ranks; each local loss is a share of the global mean).
    loss_factor: Callable[[int], float] = float
    #: single-process model -> why the bug cannot exist in it (the case is then skipped), else None.
    needs_model: Callable | None = None
    #: (single-process model, the global batch) -> why the case's inputs cannot show the bug (skipped), else None.
    needs_inputs: Callable | None = None
    #: single-process model -> more rules for `tp_plan`, read from its modules (for plans whose keys differ
    #: from family to family).
    tp_plan_from: Callable | None = None
    #: checkpoint.roundtrip: model -> a context manager around the gathered `save_pretrained` (part a).
    save_plant: Callable | None = None
    #: checkpoint.roundtrip: model -> a context manager around each sharded (DCP) save (parts b, e).
    dcp_save_plant: Callable | None = None
    #: checkpoint.roundtrip: () -> a context manager around each DCP load into a parallel model (parts c, d, e).
    dcp_load_plant: Callable | None = None
    #: checkpoint.roundtrip: () -> a context manager around the optimizer's distributed load (part e).
    optimizer_load_plant: Callable | None = None
    #: () -> the `Trainer` subclass parity.steps trains the parallel model with (None: transformers' own `Trainer`).
    trainer_plant: Callable | None = None
    #: The bug needs a model whose output head is tied to its input embedding (`needs_model` says so on the ranks;
    #: for a bundled fixture the tier knows it from the config, `will_run`, before any rank starts).
    trainer_needs_tied: bool = False

    def bound(self, ref) -> "Plant":
        """This plant with the rules `tp_plan_from` reads from the single-process model merged in."""
        if self.tp_plan_from is None:
            return self
        import dataclasses

        return dataclasses.replace(self, tp_plan={**self.tp_plan, **self.tp_plan_from(ref)}, tp_plan_from=None)


def _needs_tp(layout) -> str | None:
    return None if layout.tp > 1 else f"layout {layout} has no tensor parallelism"


def _needs_tp_without_ep(layout) -> str | None:
    """TP where no expert plan takes over the experts' rules (under EP the experts' packed rule is not used)."""
    if layout.ep > 1:
        return f"layout {layout} runs the experts expert-parallel, so their tp rules do not apply"
    return _needs_tp(layout)


def _needs_resume(layout) -> str | None:
    """checkpoint.roundtrip (e) trains; a pipeline forward returns no loss to train on."""
    return None if layout.pp == 1 else f"layout {layout} has pipeline stages, where the resume part cannot train"


def _needs_dp(layout) -> str | None:
    return None if layout.dp > 1 and layout.pp == 1 else f"layout {layout} has no data parallelism"


def _skip_dp_reduce(model, layout) -> None:
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            # HSDP: the replicas' all-reduce left out; FSDP alone: gradient sync left off after accumulation.
            if layout.dpr > 1:
                module.set_requires_all_reduce(False)
            else:
                module.set_requires_gradient_sync(False)


def _rowwise_with_bias(model) -> list:
    """The modules transformers runs row-parallel that hold a bias (gpt_neox's dense, phi's fc2, ...)."""
    from paracheck.adapters.transformers.structure import style_of

    plan = dict(getattr(model, "tp_plan", None) or {})
    return [m for name, m in model.named_modules()
            if (style_of(name, plan, False) or "").startswith("rowwise") and getattr(m, "bias", None) is not None]


def _bias_before_reduce(model, layout) -> None:
    """Each rank adds its row-parallel bias to its partial sum, so the all-reduce counts it tp times: the same
    output as adding (tp - 1) more copies after transformers' own reduction, which is how it is planted. The
    row-parallel modules of the loaded model are those whose weight is split on tp by input rows. Where the layout
    leaves none (the plan's only biased row-parallel modules are experts an EP layout dispatches instead), the bug
    cannot exist there: refused by name, never planted to read `missed`."""
    planted = 0
    for module in model.modules():
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        if bias is None or not hasattr(weight, "placements") or "tp" not in (weight.device_mesh.mesh_dim_names or ()):
            continue
        placement = weight.placements[weight.device_mesh.mesh_dim_names.index("tp")]
        if getattr(placement, "dim", None) in (1, -1) and weight.ndim == 2:
            module.register_forward_hook(lambda m, args, out, extra=layout.tp - 1: out + extra * _local(m.bias))
            planted += 1
    if not planted:
        raise Refused(f"tf-rowwise-bias-before-reduce: layout {layout} splits no module with a bias by input rows on "
                      "tp, so no bias is counted tp times")


def _bias_shows(ref) -> str | None:
    """Why a row-parallel bias counted tp times cannot show on this model, else None: it has no such bias, or every
    one is exactly zero (transformers initializes biases so; a trained or drawn checkpoint has them nonzero), so the
    extra copies add nothing."""
    biased = _rowwise_with_bias(ref)
    if not biased:
        return "the model has no row-parallel module with a bias"
    if all(not _local(m.bias).detach().any() for m in biased):
        return (f"the model's {len(biased)} row-parallel biases are all exactly zero (as transformers initializes "
                "them), so a bias counted tp times adds nothing")
    return None


def _packed_as_colwise(ref) -> dict:
    """Every packed (fused gate and up) rule planned plain colwise: the fused weight split in one run of rows,
    so one rank holds the gate halves and another the up halves, instead of each rank a slice of both."""
    return {k: "colwise" for k, v in dict(getattr(ref, "tp_plan", None) or {}).items() if v == "packed_colwise"}


def _routers(model) -> list:
    """The modules that pick each token's experts: a module whose class names it a router, or a gate that has a
    `top_k` (HunYuan's `HunYuanMoEV1Gate`; a linear-attention forget gate has none), holding the weights that
    score the experts, its own or a child projection's (LongcatFlash's `classifier`, Afmoe's `gate`, Gemma4's
    `proj`, which reads its top-k from the config)."""
    return [m for m in model.modules() if _named_router(m) and any(True for _ in m.parameters())]


def _named_router(module) -> bool:
    name = type(module).__name__
    return "router" in name.lower() or (name.endswith("Gate") and hasattr(module, "top_k"))


def _topk_on_shard(model, layout) -> None:
    """Each router takes its top-k among this rank's share of the experts first (as a router whose logits were
    split across ranks by expert would): the experts a token is sent to differ from rank to rank. Planted by
    wrapping each router's own forward: within it, every expert score it computes (an `F.linear` whose output has
    one column per expert) or takes a top-k of (`torch.topk`, `Tensor.topk`) has the other ranks' experts pushed
    down first, so whatever picks the experts (a top-k, Phi-MoE's sparsemixer) picks this rank's share."""
    from unittest import mock

    import torch
    import torch.nn.functional as F

    from paracheck.world.localworld import per_rank_tensors

    shards, experts = max(layout.tp, layout.ep), _expert_count(model.config)
    linear, topk = F.linear, torch.topk

    def local(scores, dim=-1):
        count = scores.shape[dim]  # a pool the router picks from (routed experts and any others it scores alike)
        # each rank's own share, by its rank: in a local world every rank's at once (a Python index would be one)
        outside = per_rank_tensors(lambda rank: _outside_share(rank % shards, shards, count, scores.device))
        shape = [1] * scores.dim()
        shape[dim] = count
        return scores - 10.0 * outside.view(shape).to(scores.dtype)

    def local_linear(*args, **kwargs):
        out = linear(*args, **kwargs)
        return local(out) if out.shape[-1] == experts else out  # an expert score, not another projection's output

    def local_topk(scores, k, dim=-1, *args, **kwargs):
        _, chosen = topk(local(scores, dim), k, dim, *args, **kwargs)
        return torch.return_types.topk((scores.gather(dim, chosen), chosen))

    def local_tensor_topk(scores, k, dim=-1, *args, **kwargs):
        return local_topk(scores, k, dim, *args, **kwargs)

    for router in _routers(model):
        forward = router.forward

        def bent(*args, forward=forward, **kwargs):
            with mock.patch.object(F, "linear", local_linear), mock.patch.object(torch, "topk", local_topk), \
                    mock.patch.object(torch.Tensor, "topk", local_tensor_topk):
                return forward(*args, **kwargs)

        router.forward = bent


def _outside_share(index: int, shards: int, count: int, device):
    """True for the `count` experts outside share `index` of `shards` (the router control's mask)."""
    import torch

    outside = torch.ones(count, dtype=torch.bool, device=device)
    outside[index * count // shards:(index + 1) * count // shards] = False
    return outside


#: The config keys of a routed expert pool's size and of how many experts each token goes to (`fitting`'s too).
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk", "top_k_experts")


def _expert_count(config) -> int | None:
    config = getattr(config, "text_config", None) or config
    return next((getattr(config, k) for k in EXPERT_KEYS if isinstance(getattr(config, k, None), int)), None)


def every_expert_routed(config) -> str | None:
    """Why a top-k taken on a shard cannot show on `config`: every token goes to every expert (its top-k is at least
    its expert count), so any top-k picks them all. None where it can show (or the config names neither)."""
    experts = _expert_count(config)
    inner = getattr(config, "text_config", None) or config
    k = next((getattr(inner, key) for key in TOP_K_KEYS if isinstance(getattr(inner, key, None), int)), None)
    if experts is None or k is None or k < experts:
        return None
    return (f"every token goes to every expert ({next(x for x in TOP_K_KEYS if getattr(inner, x, None) == k)}={k} "
            f"of {experts} experts), so a top-k taken on a shard picks the same experts")


def _router_shows(ref) -> str | None:
    if not _routers(ref):
        return "the model has no top-k router (a dense model)"
    return every_expert_routed(ref.config)


def _needs_split_experts(layout) -> str | None:
    if layout.tp > 1 or layout.ep > 1:
        return None
    return f"layout {layout} splits no experts across ranks (neither tp nor ep)"


def _needs_pp(layout) -> str | None:
    return None if layout.pp > 1 else f"layout {layout} has no pipeline stages"


def _needs_two_mesh_dims(layout) -> str | None:
    split = [t for t in ("dpr", "fsdp", "tp") if getattr(layout, t) > 1]
    return None if len(split) >= 2 else f"layout {layout} puts parameters on a mesh of fewer than two dimensions"


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _needs_replicas(layout) -> str | None:
    """Parameters replicated across data-parallel ranks: HSDP's replicas (every parameter), not FSDP's shards."""
    if layout.dpr > 1 and layout.pp == 1:
        return None
    return f"layout {layout} has no dp_replicate dimension, so no decayed parameter is replicated"


def _needs_sharded_grads(layout) -> str | None:
    """Gradients split across ranks (FSDP's shards, TP's, the experts'), so a shard's norm is not the whole one."""
    if layout.pp == 1 and (layout.fsdp > 1 or layout.tp > 1 or layout.ep > 1):
        return None
    return f"layout {layout} splits no gradient across ranks, so each rank's norm is the whole one"


def _local_norm_trainer():
    """A `Trainer` whose gradient clipping takes the norm of this rank's own shards only: each rank scales its
    gradients by its own factor, and the norm it logs is its shard's."""
    import torch
    from transformers import Trainer

    class LocalNormTrainer(Trainer):
        def _clip_grad_norm(self, model):
            grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            factor = torch.clamp(self.args.max_grad_norm / (norm + 1e-6), max=1.0)
            for grad in grads:
                grad.mul_(factor)
            return norm

    return LocalNormTrainer


def _replicated(param) -> bool:
    """Whether some other rank holds the same values: a DTensor replicated on a mesh dimension, or a plain tensor."""
    placements = getattr(param, "placements", None)
    return placements is None or any(p.is_replicate() for p in placements)


def _decay_twice_trainer():
    """A `Trainer` whose optimizer, after each step, decays the replicated parameters of decayed groups once more
    (AdamW's decoupled decay, p *= 1 - lr * weight_decay, applied a second time)."""
    import torch
    from transformers import Trainer

    def decay_again(optimizer, args, kwargs):
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in (p for p in group["params"] if group["weight_decay"] and _replicated(p)):
                    _local(param).mul_(1 - group["lr"] * group["weight_decay"])

    class DecayTwiceTrainer(Trainer):
        def create_optimizer(self, model=None):
            optimizer = super().create_optimizer(model)
            optimizer.register_step_post_hook(decay_again)
            return optimizer

    return DecayTwiceTrainer


def _needs_trainer(layout) -> str | None:
    return None if layout.pp == 1 else f"layout {layout}: transformers' Trainer cannot train a pipeline (see parity.steps)"


def _rule_of(ref, module) -> dict:
    """{the model's tp_plan key naming `module`: "replicate"}, or {} where its plan names it under no key or already
    plans it `replicate` (the plant would change nothing: inkling's text plans keep their embedding whole): the key
    differs from class to class (`model.embed_tokens`, a vision-language model's `model.language_model.embed_tokens`)."""
    name = next((n for n, m in ref.named_modules() if m is module), None) if module is not None else None
    return {name: "replicate"} if (ref.tp_plan or {}).get(name, "replicate") != "replicate" else {}


def _embedding_replicated(ref) -> dict:
    return _rule_of(ref, ref.get_input_embeddings())


def _head_replicated(ref) -> dict:
    return _rule_of(ref, ref.get_output_embeddings())


def _embedding_shows(ref) -> str | None:
    """Why planning the input embedding replicate cannot show on this model, else None."""
    if not _embedding_replicated(ref):
        return "the model's tp_plan does not split its input embedding (no rule, or replicate already)"
    if _untied(ref) is None:  # `_untied` is None where the head is tied
        return ("the model ties its input embedding to its output head, planned colwise: one weight cannot be "
                "planned replicate and colwise (its forward raises)")
    return None


def _vlm_head_shows(ref) -> str | None:
    """Where a wrapper's missing head rule can exist: a model whose plan reaches a nested language model, with a
    head of its own planned (and untied: a tied head planned replicate beside a sharded embedding raises)."""
    if not any(".language_model." in f".{key}" for key in ref.tp_plan or {}):
        return "the model has no nested language model (its own plan is the language model's)"
    if not _head_replicated(ref):
        return "the model's tp_plan does not split its output head (no rule, or replicate already)"
    if _untied(ref) is None:  # `_untied` names what a tied-only control lacks: None means tied
        return "the model ties its output head to its input embedding, planned rowwise: a head planned replicate " \
               "beside it raises"
    return None


def _untied(ref) -> str | None:
    head, embed = ref.get_output_embeddings(), ref.get_input_embeddings()
    tied = head is not None and embed is not None and head.weight is embed.weight
    return None if tied else "the model does not tie its output head to its input embedding"


def _untied_trainer():
    """A `Trainer` that, preparing the model for training, gives the output head a weight of its own: a copy of
    the tied embedding's (whole, so the forward is unchanged), in a new head module, so from the first step on
    the embedding learns from its input use only and the head from its output use only."""
    import torch
    from transformers import Trainer

    from paracheck.checks.shards import full

    class UntiedTrainer(Trainer):
        def create_optimizer(self, model=None):
            model = model or self.model
            weight = full(model.get_input_embeddings().weight.detach()).clone()
            untied = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype,
                                     device=weight.device)
            untied.weight = torch.nn.Parameter(weight)
            model.set_output_embeddings(untied)
            return super().create_optimizer(model)

    return UntiedTrainer


def _stage_one_short(model, layout) -> str | None:
    """Each stage but the last hands the next the hidden states its last layer was given, not what that layer
    returned (the stage's layer range one short at its end: the layer's work is lost). Planted as a forward hook
    on that layer; returns the layer's name (where localization must find it), None on the last stage."""
    from transformers.distributed.pipeline_parallel import PipelineIdentityLayer

    if model._pp_stage.pp_is_last_stage:
        return None
    layers = getattr(model, model.base_model_prefix).layers
    index = max(i for i, layer in enumerate(layers) if not isinstance(layer, PipelineIdentityLayer))
    layers[index].register_forward_hook(lambda module, args, out: args[0])
    return f"{model.base_model_prefix}.layers.{index}"


def _attentions(model) -> list:
    """The attention modules that read and write a layer's cache (`layer_idx`, a `q_proj`)."""
    return [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "q_proj")]


#: The TP styles that leave a projection's output split by head on each rank (`colwise_gather_output` gathers every
#: head back, `replicate` never splits): where a key or value projection has one, each rank caches its own heads.
HEADS_SPLIT = ("colwise", "unit_colwise", "packed_colwise")
#: The projections whose outputs a layer caches (MLA's `kv_b_proj` makes the per-head keys and values).
KV_PROJECTIONS = ("k_proj", "v_proj", "kv_b_proj")


def split_attentions(model) -> list:
    """The attentions whose cached keys and values TP splits by head, read from the model's TP plan: a key or value
    projection planned in a `HEADS_SPLIT` style. An attention the plan leaves whole (an encoder-decoder's cross-
    attention, which T5Gemma's plan does not name) or gathers back (olmo2's `colwise_gather_output`) caches every
    head on every rank already: there is no other rank's block of heads to read instead of its own."""
    from paracheck.adapters.transformers.structure import style_of

    plan = dict(getattr(model, "tp_plan", None) or {})
    return [m for name, m in model.named_modules() if hasattr(m, "layer_idx") and hasattr(m, "q_proj")
            and any(style_of(f"{name}.{p}", plan, False) in HEADS_SPLIT for p in KV_PROJECTIONS if hasattr(m, p))]


def _cache_heads_split(ref) -> str | None:
    """Why reading the first heads' cache cannot show on this model (the control is refused, never `missed`)."""
    if not _attentions(ref):
        return "the model has no attention module with a q_proj and a layer_idx"
    if not split_attentions(ref):
        return (f"its tp_plan splits no attention's cached keys and values by head (no {'/'.join(KV_PROJECTIONS)} "
                f"planned {' or '.join(HEADS_SPLIT)}), so every rank's cache holds every head already")
    return None


def _tp_group(attention):
    """The TP group an attention's split key/value projection is sharded over."""
    for name in KV_PROJECTIONS:
        weight = getattr(getattr(attention, name, None), "weight", None)
        if "tp" in (getattr(getattr(weight, "device_mesh", None), "mesh_dim_names", None) or ()):
            return weight.device_mesh.get_group("tp")
    raise RuntimeError(f"{type(attention).__name__}: its tp_plan splits its keys and values, but no key or value "
                       "projection is sharded on a tp mesh dimension")


def _cache_first_heads(model, layout) -> None:
    """Each decode step reads the key/value cache as if it held every head: every TP rank takes the first heads
    (TP coordinate 0's) instead of its own. Planted around each attention's forward by bending its cache's `update`
    for that call, on decode steps only (one new token): the prompt's forward and every pass without a cache run as
    they were. Only in the attentions whose cache the TP plan splits by head (`split_attentions`); a model with none
    is refused before (`_cache_heads_split`)."""
    for attention in split_attentions(model):
        group = _tp_group(attention)
        forward = attention.forward

        def bent(*args, forward=forward, group=group, **kwargs):
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            if cache is None:
                return forward(*args, **kwargs)
            update = cache.update

            def first_heads(keys, values, *rest, **more):
                k, v = update(keys, values, *rest, **more)
                return (_first_block(k, group), _first_block(v, group)) if keys.shape[-2] == 1 else (k, v)

            cache.update = first_heads
            try:
                return forward(*args, **kwargs)
            finally:
                del cache.update

        attention.forward = bent


def _first_block(tensor, group):
    """TP coordinate 0's block of heads (dim 1), on every rank of `group`."""
    import torch
    import torch.distributed as dist

    blocks = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(blocks, tensor.contiguous(), group=group)
    return blocks[0]


def _rotaries(model) -> list:
    """The rotary embeddings of the model's text decoder, whose positions decoding advances (`get_decoder`): an
    audio or vision encoder's own rotary (MusicFlamingo's takes timestamps, NeMo's conformer its frames) is not."""
    import torch

    try:
        decoder = model.get_decoder()
    except (AttributeError, ValueError):  # a model with no decoder to name: its own modules
        decoder = None
    root = decoder if isinstance(decoder, torch.nn.Module) else model
    return [m for m in root.modules() if type(m).__name__.endswith("RotaryEmbedding")]


def _positions_stuck(model, layout) -> None:
    """From the second decode step on, the rotary embedding gets the first decode step's positions again: the
    position stops advancing after the first decode step. Planted around each rotary module's forward; a call with
    more than one position (a prompt, any pass without a cache) runs as it was and starts the count again."""
    for rotary in _rotaries(model):
        forward, first = rotary.forward, {}

        def bent(x, *args, forward=forward, first=first, **kwargs):
            args = list(args)
            positions = args[0] if args else kwargs.get("position_ids")
            if positions is None:  # a call that hands no positions (computed inside): nothing to hold
                return forward(x, *args, **kwargs)
            if positions.shape[-1] > 1:
                first.clear()
            else:
                positions = first.setdefault("positions", positions)
            if args:
                args[0] = positions
            else:
                kwargs["position_ids"] = positions
            return forward(x, *args, **kwargs)

        rotary.forward = bent


def _next_token_from_first_stage(model, layout) -> str:
    """On decode steps every stage takes its logits from the first pipeline stage instead of the last: the first
    stage's copy of the previous step's logits (the last position of the prompt's, after the prompt's forward).
    Planted by wrapping transformers' own `broadcast_from_last` of the stage; a forward of more than one token (a
    prompt, every pass without a cache) runs as it was. Returns where it plants (the model's own call)."""
    import torch.distributed as dist

    stage, kept = model._pp_stage, {}
    broadcast = stage.broadcast_from_last

    def decoding(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        kept["decode"] = ids is not None and ids.shape[-1] == 1

    def bent(tensor, *, dtype, device):
        logits = broadcast(tensor, dtype=dtype, device=device)
        if kept.get("decode") and "last" in kept:
            stale = kept["last"].clone()
            dist.broadcast(stale, src=dist.get_global_rank(stage.pp_group, 0), group=stage.pp_group)
            kept["last"] = logits[:, -1:].clone()
            return stale.to(device=device, dtype=dtype)
        kept["last"] = logits[:, -1:].clone()
        return logits

    model.register_forward_pre_hook(decoding, with_kwargs=True)
    stage.broadcast_from_last = bent
    return "<root>"


def _tp_coordinate(model) -> tuple[int, int]:
    """(this rank's tp coordinate, the tp degree), read from any parameter sharded on a `tp` mesh dimension."""
    for param in model.parameters():
        names = getattr(getattr(param, "device_mesh", None), "mesh_dim_names", None) or ()
        if "tp" in names:
            mesh = param.device_mesh["tp"]
            return mesh.get_local_rank(), mesh.size()
    raise RuntimeError("the model has no parameter sharded on a tp mesh dimension")


def _share(length: int, rank: int, size: int) -> slice:
    """Rank `rank`'s contiguous share of `length` (ceil-sized blocks, the last one shorter)."""
    block = -(-length // size)
    return slice(min(length, rank * block), min(length, (rank + 1) * block))


def _share_mask(length: int, rank: int, size: int, device=None):
    """True on rank `rank`'s share of `length` (`_share`), False elsewhere."""
    import torch

    mask = torch.zeros(length, dtype=torch.bool, device=device)
    mask[_share(length, rank, size)] = True
    return mask


def _each_tp_rank(fn, rank):
    """`fn(rank)` for a plain tp coordinate; for a local world's per-rank one, every rank's `fn` at once, each tensor
    a `LocalTensor` (`per_rank_tensors`): a share sliced by it would be one Python value standing for every rank
    (`RankDependent`), and tensors of one shape on every rank hold shares of any length."""
    import torch

    if not isinstance(rank, torch.SymInt):
        return fn(rank)
    from paracheck.world.localworld import local_value, per_rank_tensors

    return per_rank_tensors(lambda r: fn(local_value(rank, r)))


def _tower_read_layer(model):
    """(name, module) of the vision tower's layer whose output the projector reads (`vision_feature_layer` indexes
    the tower's hidden states, so layer k's output is `hidden_states[k + 1]`; a negative index is the same layer), or
    None where the model has no tower and projector of that shape (no `vision_tower`, `multi_modal_projector` or
    int/list `vision_feature_layer`)."""
    import torch

    index = getattr(model.config, "vision_feature_layer", None)
    index = index[-1] if isinstance(index, (list, tuple)) and index else index
    names = {n.rsplit(".", 1)[-1]: n for n, _ in model.named_modules()}
    if not isinstance(index, int) or "vision_tower" not in names or "multi_modal_projector" not in names:
        return None
    tower = model.get_submodule(names["vision_tower"])
    # The tower's layer list: the one as long as its config's layers where it says (a tiny tower may hold another).
    depth = getattr(getattr(model.config, "vision_config", None), "num_hidden_layers", None)
    lists = [m for m in tower.modules() if isinstance(m, torch.nn.ModuleList)]
    layers = next((m for m in lists if len(m) == depth), None) or max(lists, key=len, default=None)
    if not layers or index == 0 or not -len(layers) <= (index - 1 if index > 0 else index) < len(layers):
        return None
    layer = layers[index - 1 if index > 0 else index]
    return next(f"{names['vision_tower']}.{n}" for n, m in tower.named_modules() if m is layer), layer


def _tower_feeds_projector(ref) -> str | None:
    """Why a tower's output left partial cannot be planted on this model, else None."""
    import torch

    found = _tower_read_layer(ref)
    if found is None:
        return ("the model has no vision tower feeding a multi_modal_projector through a vision_feature_layer "
                "(no vision plan to leave unreduced)")
    if not any(isinstance(m, torch.nn.Linear) for m in found[1].modules()):
        return f"the tower's read layer {found[0]} has no linear projection to split by rows"
    return None


def _tower_left_partial(model, layout) -> str:
    """The vision tower's read layer's last projection (CLIP's `mlp.fc2`) run row-parallel with its all-reduce left
    off: each TP rank multiplies its share of the input features by its share of the weight's columns and adds the
    bias, and that partial sum, not the whole, is what the layer returns and the projector (which expects the whole
    feature) reads. Returns the planted layer's name."""
    import torch

    name, layer = _tower_read_layer(model)
    rank, size = _tp_coordinate(model)
    last = [m for m in layer.modules() if isinstance(m, torch.nn.Linear)][-1]
    if "tp" in (getattr(getattr(last.weight, "device_mesh", None), "mesh_dim_names", None) or ()):
        # a tower the model's own plan splits already: its reduction is transformers' to drop, not this plant's
        raise Refused(f"tf-vlm-tower-partial: {name}'s last projection is planned by the model's own tp_plan, so the "
                      "kit cannot leave a replicated one partial there")

    def partial(x, *args, module=last, **kwargs):
        # this rank's rows of the input features, the others zeroed: its share of the contraction, as a mask
        rows = _each_tp_rank(lambda r: _share_mask(module.in_features, r, size, x.device), rank)
        bias = None if module.bias is None else _local(module.bias)
        return torch.nn.functional.linear(x * rows.to(x.dtype), _local(module.weight), bias)

    last.forward = partial
    return name


def _placeholder_owner(ref):
    """The module whose `get_placeholder_mask` marks the image placeholders in the row (llava's `LlavaModel`)."""
    return next((m for m in ref.modules() if hasattr(type(m), "get_placeholder_mask")), None)


def _placeholders_shown(ref) -> str | None:
    if _placeholder_owner(ref) is None:
        return "the model marks no image placeholder tokens in its input ids (no get_placeholder_mask)"
    if getattr(ref.config, "image_token_id", None) is None:
        return "the model's config names no image placeholder token (no image_token_id)"
    return None


def _placeholders_given(ref, batch) -> str | None:
    ids = batch.get("input_ids")
    if ids is None or not bool((ids == ref.config.image_token_id).any()):
        return "the inputs hold no image placeholder token, so no image reaches the text to be misplaced"
    return None


def _placeholders_on_shard(model, layout) -> str:
    """Each TP rank computes the image placeholders' positions from its own share of the sequence (as a sequence-
    parallel split over the tp ranks gives it) and scatters the image features there, while the rank runs the whole
    row: a placeholder outside its share keeps the placeholder token's own embedding on that rank, and the first
    features go to its share's first placeholders. Planted by bending `get_placeholder_mask` (its count check runs
    on the whole mask first, so it raises nothing). Returns the owner's name: the forward that scatters them."""
    owner = _placeholder_owner(model)
    rank, size = _tp_coordinate(model)
    whole = owner.get_placeholder_mask

    def on_shard(*args, **kwargs):
        masks = whole(*args, **kwargs)
        # families that take videos or audio too return (image, video[, audio]) masks: the image's is first
        mask = masks[0] if isinstance(masks, tuple) else masks
        kept = _each_tp_rank(lambda r: _share_mask(mask.shape[1], r, size, mask.device), rank)
        mine = mask & kept.view(1, -1, *[1] * (mask.dim() - 2))
        return (mine, *masks[1:]) if isinstance(masks, tuple) else mine

    owner.get_placeholder_mask = on_shard
    return next(name for name, m in model.named_modules() if m is owner) or "<root>"


_NORMS = ("model.layers.*.self_attn.q_norm", "model.layers.*.self_attn.k_norm")

_ENTRIES = (
    (Control("tf-norm-replicate", "Qwen3's per-head q_norm/k_norm planned replicate instead of "
             "replicated_with_grad_allreduce: each TP rank keeps its heads' share of their gradient",
             (CheckId.GRADS,), _needs_tp, plants_in="*.q_norm.weight|*.k_norm.weight"),
     Plant(tp_plan=dict.fromkeys(_NORMS, "replicate"), needs_rules=_NORMS)),
    (Control("tf-skip-dp-reduce", "data-parallel gradient reduction left off (HSDP: the replicas' all-reduce; "
             "FSDP: gradient sync)", (CheckId.GRADS,), _needs_dp, plants_in="<root>"),
     Plant(after_load=_skip_dp_reduce)),
    (Control("tf-grad-divide", "the local loss not scaled by the data-parallel degree before backward, while "
             "FSDP averages gradients over it: every gradient dp times too small, loss exact",
             (CheckId.GRADS,), _needs_dp, plants_in="<root>"),
     Plant(loss_factor=lambda dp: 1.0)),
    (Control("tf-embed-replicate", "the input embedding planned replicate instead of embedding_rowwise: numbers "
             "exact, the vocabulary no longer sharded", (CheckId.TP_SHARDS,), _needs_tp),
     Plant(tp_plan_from=_embedding_replicated, needs_model=_embedding_shows)),
    (Control("tf-vlm-head-unplanned", "a vision-language wrapper's own plan missing its output head while its "
             "language model's rules apply (as transformers#45124's class had no lm_head entry): the head runs "
             "whole, numbers exact, the vocabulary no longer sharded", (CheckId.TP_SHARDS,), _needs_tp),
     Plant(tp_plan_from=_head_replicated, needs_model=_vlm_head_shows)),
    (Control("tf-rowwise-bias-before-reduce", "a row-parallel bias added on every rank before the reduction, "
             "so the sum counts it tp times (placements exact)", (CheckId.INFERENCE, CheckId.FORWARD),
             _needs_tp),
     Plant(after_load=_bias_before_reduce, needs_model=_bias_shows)),
    (Control("tf-packed-as-colwise", "a fused gate-and-up projection planned colwise instead of packed_colwise: "
             "split in the wrong order, one rank holds the gates, another the ups (measured on qwen2_moe tp2: the "
             "forward stays exact, the gradients do not)", (CheckId.TP_SHARDS, CheckId.GRADS), _needs_tp_without_ep),
     Plant(tp_plan_from=_packed_as_colwise, needs_model=lambda ref: None if _packed_as_colwise(ref) else
           "the model's tp_plan has no packed_colwise rule")),
    (Control("tf-save-local-shard", "the gathered save_pretrained writes rank 0's local shards (each DTensor's "
             "to_local()) instead of whole tensors", (CheckId.CHECKPOINT,), _needs_tp),
     Plant(save_plant=checkpoint_plants.local_shard_save)),
    (Control("tf-dcp-skip-mesh-dim", "the DCP load reads each shard as if the first sharded dimension of its mesh "
             "were not there (every rank along it gets coordinate 0's piece; keys and shapes right, a strict load "
             "passes)", (CheckId.CHECKPOINT,), _needs_two_mesh_dims),
     Plant(dcp_load_plant=checkpoint_plants.skip_mesh_dim_load)),
    (Control("tf-resume-drops-optimizer", "the optimizer's distributed load finds none of its keys and loads nothing, "
             "raising nothing, so the resumed run steps on from a fresh optimizer's state (the weights load right)",
             (CheckId.CHECKPOINT,), _needs_resume),
     Plant(optimizer_load_plant=checkpoint_plants.optimizer_state_dropped)),
    (Control("tf-pp-stage-short", "each pipeline stage but the last hands the next the hidden states its last "
             "layer was given, not what that layer returned (its layer range one short at its end)",
             (CheckId.INFERENCE, CheckId.FORWARD), _needs_pp, plants_in=PLANTED),
     Plant(after_load=_stage_one_short)),
    (Control("tf-pp-local-names", "a pipeline stage saves its layers under local names (stage 1's first layer "
             "written as layers.0, not layers.N)", (CheckId.CHECKPOINT,), _needs_pp),
     Plant(dcp_save_plant=checkpoint_plants.local_layer_names)),
)

_ENTRIES += (
    (Control("tf-router-topk-on-shard", "each MoE router takes its top-k among this rank's share of the experts "
             "first, so ranks send a token to different experts", (CheckId.INFERENCE, CheckId.FORWARD),
             _needs_split_experts, plants_in="*.gate|*.router"),
     Plant(after_load=_topk_on_shard, needs_model=_router_shows)),
    (Control("tf-clip-local-norm", "the Trainer's gradient clipping takes the norm of each rank's local shards only, "
             "so each rank clips by its own factor (the norm it logs is its shard's)", (CheckId.STEPS,),
             _needs_sharded_grads),
     Plant(trainer_plant=_local_norm_trainer)),
    (Control("tf-decay-twice", "AdamW's weight decay applied a second time, after each optimizer step, to the "
             "parameters replicated across ranks (HSDP's replicas)", (CheckId.STEPS,), _needs_replicas),
     Plant(trainer_plant=_decay_twice_trainer)),
    (Control("tf-untied-embeddings", "the tied input embedding and output head untied as the Trainer prepares the "
             "sharded model (the head given a copy of its own): forward unchanged, each then learns from one use",
             (CheckId.STEPS,), _needs_trainer),
     Plant(trainer_plant=_untied_trainer, needs_model=_untied, trainer_needs_tied=True)),
)

_ENTRIES += (
    (Control("tf-cache-all-heads", "each decode step reads the key/value cache as if it held every head: every TP "
             "rank attends with the first heads' keys and values instead of its own (the prompt's forward exact)",
             (CheckId.GENERATE,), _needs_tp, plants_in="*.self_attn|*.attention|*.attn"),
     Plant(after_load=_cache_first_heads, needs_model=_cache_heads_split)),
    (Control("tf-position-stuck", "the position stops advancing after the first decode step: later decode steps "
             "take the first one's rotary positions", (CheckId.GENERATE,), lambda layout: None,
             plants_in="*rotary_emb*"),
     Plant(after_load=_positions_stuck, needs_model=lambda ref: None if _rotaries(ref) else
           "the model's text decoder has no rotary embedding module")),
    (Control("tf-pp-next-token-first-stage", "on decode steps every pipeline stage takes its next-token logits from "
             "the first stage (its copy of the previous step's) instead of the last", (CheckId.GENERATE,), _needs_pp,
             plants_in=PLANTED + "*"),
     Plant(after_load=_next_token_from_first_stage)),
)

_ENTRIES += (
    (Control("tf-vlm-tower-partial", "the vision tower's read layer's last projection run row-parallel with its "
             "all-reduce left off: the projector, which expects the whole feature, reads each TP rank's partial sum",
             (CheckId.INFERENCE, CheckId.FORWARD), _needs_tp, plants_in=PLANTED + "*"),
     Plant(after_load=_tower_left_partial, needs_model=_tower_feeds_projector)),
    (Control("tf-vlm-placeholders-on-shard", "the image placeholders' positions computed from each TP rank's share "
             "of the sequence: a rank scatters the image features into its share's placeholders only",
             (CheckId.INFERENCE, CheckId.FORWARD), _needs_tp, plants_in=PLANTED + "|*language_model.layers.0.*"),
     Plant(after_load=_placeholders_on_shard, needs_model=_placeholders_shown, needs_inputs=_placeholders_given)),
)

CONTROLS: dict[str, Control] = {c.name: c for c, _ in _ENTRIES}
PLANTS: dict[str, Plant] = {c.name: p for c, p in _ENTRIES}
NO_PLANT = Plant()


def per_rank_refusal(name: str) -> str | None:
    """Why control `name` cannot be planted once per rank (`Control.per_rank`): only a plant's `after_load` is (the
    body runs it so); a plan rule, a loss factor, a save, load or Trainer plant is handed to transformers once for
    every rank."""
    plant = PLANTS[name]
    once = [f.name for f in dataclasses.fields(Plant) if f.name not in _PLANTED_PER_RANK_OR_INERT
            and getattr(plant, f.name) != getattr(NO_PLANT, f.name)]
    if once:
        return f"{name} is planted by its {', '.join(once)}, handed to transformers once for every rank"
    return None


#: The `Plant` fields that plant nothing (what the case needs) or plant once per rank (`after_load`, which the body
#: runs per rank): any other field set refuses `per_rank`, a field added to `Plant` later too.
_PLANTED_PER_RANK_OR_INERT = ("after_load", "needs_rules", "needs_model", "needs_inputs", "trainer_needs_tied")


def applicable(layout) -> list[str]:
    return applicable_to(CONTROLS, layout)
