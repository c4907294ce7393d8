"""The pipeline cases' negative controls: bugs that live where a pipeline meets parallelism, each planted on the
parallel pipeline's transformer only, each passing every older check (a single call of the model never meets it),
each for `parity.pipeline` to catch and localize to the first step and the module where it diverges.

- `guidance-batch-split`: the guidance batch (cond and uncond in one call) dealt over the CP ranks, each rank taking
  its own sample while the sequence is still split across them, the outputs gathered back by sample. A single call
  of batch one never takes this path; the pipeline's doubled batch does.
- `rotary-shard-cached`: from the second denoising step on, every CP rank applies the first CP rank's rows of the
  rotary table (a table cached at the local length and cut from its start, not at the rank's offset). Step 1 and
  every single call are exact.
- `drift-grows`: from the second step on, one rank's first attention scales the residual it adds by 1 + DRIFT: exact
  on step 1, then an error the loop feeds back into every later step. The rank holds the start of the split sequence
  (`_drifting_rank`), so its shard holds tokens the prediction keeps.
- `cache-local-key`: a cache that decides what to reuse from this rank's own shard of the activations (diffusers'
  first-block cache with its decision taken per rank, no agreement across the CP group).

Torch is imported inside the planters only.
"""

from __future__ import annotations

from paracheck.domain.control import PLANTED, Control
from paracheck.domain.layout import Layout
from paracheck.domain.records import CheckId

#: 1 + DRIFT scales the residual `drift-grows` plants. Measured after 3 steps (the fp32 bound's multiple, `over`): at
#: 1e-4 Flux's latents move 0.41 of the bound (u2); at 1e-3 Flux2's 0.54 (u4) and 1.14 (tp4), Flux's 3.5 (u4), Wan's
#: 7.2: the smallest drift every bundled pipeline shows beyond the bound by step 2 is 1e-2.
DRIFT = 1e-2


def _needs_cp(layout: Layout) -> str | None:
    return None if layout.has_cp else f"layout {layout} has no context parallelism: no rank holds a shard to mistake"


def _always(layout: Layout) -> str | None:
    return None


# -- when a planted bug acts ------------------------------------------------------------------------------------


def _step_watch(model):
    """A function saying whether the transformer call now running belongs to the pipeline's second step or a later
    one: a pre-hook (first in line) keeps the first call's timestep, and a later step calls with another."""
    state = {"first": None, "later": False}

    def watch(module, args, kwargs):
        t = kwargs.get("timestep")
        value = float(t.flatten()[0]) if t is not None and hasattr(t, "flatten") and t.numel() else None
        if state["first"] is None:
            state["first"] = value
        state["later"] = value != state["first"]

    model.register_forward_pre_hook(watch, with_kwargs=True, prepend=True)
    return lambda: state["later"]


def first_attention(model):
    """The first block's first attention (`transformer_blocks.0.attn`, `blocks.0.attn1`) and its name: the residual
    branch a drift scales."""
    for stack_name in ("transformer_blocks", "blocks"):
        stack = getattr(model, stack_name, None)
        if stack is not None and len(stack):
            for name in ("attn", "attn1"):
                if hasattr(stack[0], name):
                    return f"{stack_name}.0.{name}", getattr(stack[0], name)
    raise ValueError(f"{type(model).__name__} has no transformer_blocks.0.attn or blocks.0.attn1 to plant in")


def rotary_module(model):
    """The model's rotary-table module (`pos_embed`, `rope`) and its name."""
    for name in ("pos_embed", "rope"):
        module = getattr(model, name, None)
        if module is not None:
            return name, module
    raise ValueError(f"{type(model).__name__} has no pos_embed or rope module to plant in")


def _tensors_mapped(value, fn):
    import torch

    if isinstance(value, torch.Tensor):
        return fn(value) if value.is_floating_point() or value.is_complex() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_tensors_mapped(v, fn) for v in value)
    return value


# -- what each control plants --------------------------------------------------------------------------------


def _drift_grows(model, applied, _):
    import torch

    from paracheck.adapters.diffusers.checks import cp_process_group
    from paracheck.world.localworld import per_rank_tensors
    from paracheck.world.regions import once_per_rank

    later = _step_watch(model)
    _, attention = first_attention(model)
    target = once_per_rank(lambda: _drifting_rank(cp_process_group(applied)))
    # the drifting rank's factor as a tensor, 1 on the others (exact): in a local world each rank's at once,
    # where a Python flag of this rank's would be one for all of them
    factor = per_rank_tensors(lambda rank: torch.tensor(1 + DRIFT if rank == target else 1.0))

    def scale(module, args, output):
        if later():
            return _tensors_mapped(output, lambda t: t * factor.to(t))
        return output

    attention.register_forward_hook(scale)


def _drifting_rank(cp_group) -> int:
    """The rank a drift plants on: the last one holding the start of the split sequence (the first rank of its CP
    group; the last rank without CP). A pipeline may append tokens it drops from the prediction (Flux Kontext's
    condition picture): the shard holding the sequence's start always holds tokens the latents keep. Under TP it is
    never rank 0 where the world has another TP rank, so rank 0's trace reads the drifted copy from a peer."""
    import torch.distributed as dist

    if cp_group is None:
        return dist.get_world_size() - 1
    heads: list = [None] * dist.get_world_size()
    dist.all_gather_object(heads, dist.get_process_group_ranks(cp_group)[0])
    return max(heads)


def _rotary_shard_cached(model, applied, _):
    import torch.distributed as dist

    from paracheck.adapters.diffusers.checks import cp_process_group

    later = _step_watch(model)
    _, rope = rotary_module(model)
    group = cp_process_group(applied)
    first = dist.get_process_group_ranks(group)[0]

    def first_ranks_rows(t):
        t = t.contiguous().clone()
        dist.broadcast(t, src=first, group=group)
        return t

    def cached(module, args, output):
        return _tensors_mapped(output, first_ranks_rows) if later() else output

    rope.register_forward_hook(cached)


def _guidance_batch_split(model, applied, _):
    import torch
    import torch.distributed as dist

    from paracheck.adapters.diffusers.checks import cp_process_group
    from paracheck.world.localworld import group_members, per_rank_tensors

    group = cp_process_group(applied)
    size = dist.get_world_size(group)
    # this rank's place in its CP group as a tensor: in a local world each rank's at once, where a Python int of
    # this rank's would be one for all of them (a slice by it raised RankDependent)
    index = per_rank_tensors(lambda rank: torch.tensor([group_members(group, rank).index(rank)]))
    state = {"batch": 1}

    def deal(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        batch = int(hidden.shape[0]) if hidden is not None else 1
        state["batch"] = batch
        if batch < 2:
            return None
        mine = index % batch
        take = lambda t: t.index_select(0, mine.to(t.device)) if t.dim() and t.shape[0] == batch else t  # noqa: E731
        return (tuple(_tensors_mapped(a, take) for a in args),
                {k: _tensors_mapped(v, take) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})

    def gather(module, args, kwargs, output):
        batch = state["batch"]
        if batch < 2:
            return output

        def back(t):
            pieces = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(pieces, t.contiguous(), group=group)
            return torch.cat(pieces)[:batch]
        return _tensors_mapped(output, back)

    model.register_forward_pre_hook(deal, with_kwargs=True)
    model.register_forward_hook(gather, with_kwargs=True)


def _cache_local_key(model, applied, _):
    """Planted by the body once the cache is on (`plant_cache`): nothing to do on the bare model."""


def plant_cache(pipe, applied, control: str | None) -> str | None:
    """`cache-local-key`, once the first-block cache is on the parallel transformer: each CP rank decides from its own
    shard whether to reuse the cached residual of the remaining blocks, as diffusers' first-block cache does, at a
    threshold the ranks' shards fall on both sides of (the midpoint of their change ratios, one all-gather a call).
    Every rank still runs the remaining blocks, so every collective is met (diffusers' own cache, whose reusing rank
    skips them, leaves the computing ones waiting in the next all-to-all: docs/upstream/fbc_local_decision.md); a
    rank that decided to reuse replaces their result with the cached residual, as a skip would. Returns where it
    planted (the cache's tail block, whose output a reusing rank replaces), for the localization to name."""
    if control != "cache-local-key":
        return None
    from paracheck.adapters.diffusers import library
    from paracheck.adapters.diffusers.checks import cp_process_group

    head, tail_block, tail_hook = library.first_block_cache_hooks(pipe.transformer)
    mine = {"reuse": None, "tail": None}  # None: no decision yet (the tail hook then leaves its output)
    # Replaces the guard `agree.guard` set on the parallel pipeline: this plant decides per rank on purpose, and
    # `decide` always computes (the reuse is the tail hook's), so the ranks cannot part in a collective.
    head._should_compute_remaining_blocks = _local_decision(head, cp_process_group(applied), mine)
    tail_block.register_forward_hook(_reuse_when_decided(head, tail_hook, mine))
    return next(name for name, module in pipe.transformer.named_modules() if module is tail_block)


def _local_decision(head, group, mine: dict):
    """The head hook's decision, bent: always compute, noting in `mine` whether this rank's own change ratio falls
    below the midpoint of the group's (then it reuses) and the cached tail residuals."""
    import torch
    import torch.distributed as dist

    from paracheck.adapters.diffusers import library

    def decide(residual):
        shared = head.state_manager.get_state()
        previous = shared.head_block_residual
        mine["reuse"], mine["tail"] = None, shared.tail_block_residuals
        if previous is None or shared.tail_block_residuals is None:
            return True
        ratio = library.fbc_change_ratio(residual, previous).reshape(1).float()
        ratios = [torch.empty_like(ratio) for _ in range(dist.get_world_size(group))]
        dist.all_gather(ratios, ratio, group=group)
        every = torch.cat(ratios)
        low, high = every.min(), every.max()
        # this rank's choice as a 0-d bool tensor, not a Python bool: in a local world each rank's at once (a float
        # of this rank's ratio is one Python value for all of them)
        mine["reuse"] = ((low < high) & (ratio[0] <= (low + high) / 2))
        return True
    return decide


def _reuse_when_decided(head, tail_hook, mine: dict):
    """The tail block's forward hook: where this rank decided to reuse, its output replaced by the head's output plus
    the cached tail residuals, as diffusers' cache would return without running the blocks."""

    def reuse(module, args, output):
        import torch

        if mine["reuse"] is None:
            return output
        head_output = head.state_manager.get_state().head_block_output
        # where this rank reuses, the cached sum; else its own output (torch.where: either exactly)
        pick = lambda cached, own: torch.where(mine["reuse"], cached, own)  # noqa: E731
        if not isinstance(output, tuple):
            return pick(head_output + mine["tail"][0], output)
        out = list(output)
        meta = tail_hook._metadata
        i = meta.return_hidden_states_index
        out[i] = pick(head_output[0] + mine["tail"][0], out[i])
        if meta.return_encoder_hidden_states_index is not None:
            j = meta.return_encoder_hidden_states_index
            out[j] = pick(head_output[1] + mine["tail"][1], out[j])
        return tuple(out)
    return reuse


# -- the controls -----------------------------------------------------------------------------------------------

#: The places the localization of a detected case must name (`Control.plants_in`).
#: The drift's block: its first attention, where it plants; under TP that attention's output is replicated and rank 0's
#: own copy, the one a trace reads, is exact, so the first module that differs is the next one reading the drifted
#: rank's copy into a shard (`transformer_blocks.0.ff.net.0.proj` on Flux tp2), in the same block.
FIRST_ATTENTION = "*blocks.0.attn|*blocks.0.attn1|*blocks.0.*"
#: The model itself: the guidance batch is dealt over the ranks at its inputs.
ROOT = "<root>"
ROTARY = "pos_embed|rope|*attn*"

PIPELINE_CONTROLS: dict[str, Control] = {c.name: c for c in (
    Control("guidance-batch-split", "the guidance batch dealt over the CP ranks, each taking its own sample while the "
            "sequence is still split across them, outputs gathered back by sample", (CheckId.PIPELINE,), _needs_cp,
            _guidance_batch_split, plants_in=ROOT),
    Control("rotary-shard-cached", "from the second step on, every CP rank applies the first CP rank's rows of the "
            "rotary table (cached at the local length, cut from its start); step 1 exact", (CheckId.PIPELINE,),
            _needs_cp, _rotary_shard_cached, plants_in=ROTARY),
    Control("drift-grows", f"from the second step on, the first attention of the last rank holding the start of the "
            f"split sequence scales the residual it adds by 1 + {DRIFT:g}; step 1 exact", (CheckId.PIPELINE,), _always, _drift_grows, plants_in=FIRST_ATTENTION),
    Control("cache-local-key", "the first-block cache decides what to reuse from this rank's own shard, with no "
            "agreement across the CP group", (CheckId.PIPELINE,), _needs_cp, _cache_local_key, plants_in=PLANTED),
)}

#: The variant a control is planted on (a pipeline's `base` but where it needs a cache).
_VARIANT = {"cache-local-key": "first-block-cache"}


def per_rank_refusal(control: Control) -> str | None:
    """Why a pipeline control cannot be planted once per rank (`Control.per_rank`): `cache-local-key` is planted by
    `plant_cache` once the cache is on, not by its planter; the others as a model control is."""
    from paracheck.adapters.diffusers import controls

    if control.name == "cache-local-key":
        return f"{control.name} is planted by plant_cache once the cache is on, not by its planter"
    return controls.per_rank_refusal(control)


def planted_on(name: str) -> str:
    return _VARIANT.get(name, "base")


def guidance_refuses(case, p) -> str | None:
    """Why `case.control` cannot show on this pipeline beyond its layout and route (`Control.skip_reason`): the
    guidance split needs the guidance pair in one batch."""
    if case.control == "guidance-batch-split" and p.source.guidance != "batched":
        return (f"{p.source.name} runs guidance as {p.source.guidance!r}, not one call on the doubled batch: there "
                "is no guidance batch to split")
    return None
