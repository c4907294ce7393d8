"""diffusers' cache hooks by variant name: the config each builds for a pipeline, and enabling it on a transformer.

The thresholds are set so that a tiny model with random weights reuses something within the steps a cache variant
runs (diffusers' own cache testers raise them for the same reason): a cache that never reuses would test nothing.
A pipeline may override any option (`paracheck_caches = {name: {option: value}}` on its tester class). What
diffusers refuses is a skip in diffusers' words: a config its `enable_cache` raises on for this transformer, or a
cache its pipeline cannot run on one device (Flux2's pipeline enters no `cache_context`, which the first-block and
TaylorSeer caches require). FasterCache's unconditional-batch reuse needs the guidance pair in one batch: on a
pipeline that calls the transformer once per branch (or takes the scale as an input) it runs as diffusers' own
testers run it there, `is_guidance_distilled=True`; its timestep ranges leave the first step out, as diffusers'
testers' do (a skip on the first step finds its cache empty: `TypeError: 'NoneType' object is not subscriptable`),
and the first step a pipeline takes is read as the schedule's top, so one that starts below it (img2img at a
strength) computes its first step too. A cache that ran and reused nothing because diffusers turned it off (SeaCache
runs "fail-open" where the pipeline's `cache_context` gives no step, sigma and step count: every pipeline of 0.42.1
but Wan's text-to-video and Cosmos 3's) is as good as refused (`inert`: a fail-open warning and no call reused): its
case would compare two uncached runs.
"""

from __future__ import annotations


def _first_block(pipe, steps: int, guidance: str, options: dict):
    from diffusers import FirstBlockCacheConfig

    return FirstBlockCacheConfig(**dict(dict(threshold=0.8), **options))


def _faster(pipe, steps: int, guidance: str, options: dict):
    from diffusers import FasterCacheConfig

    defaults = dict(spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 901),
                    unconditional_batch_skip_range=2, unconditional_batch_timestep_skip_range=(-1, 901),
                    attention_weight_callback=_half, current_timestep_callback=_first_at_top(pipe),
                    is_guidance_distilled=guidance != "batched")
    return FasterCacheConfig(**dict(defaults, **options))


def _first_at_top(pipe):
    """`pipe.current_timestep`, but 1000 (above the skip ranges) on the loop's first step, each call at the first
    timestep until the timestep first moves: a pipeline that starts lower (img2img at strength 0.75 starts near 800)
    would otherwise skip its first step into an empty cache and raise on one device, testing nothing. A call after
    the timestep moved reads its own value, even where it equals the first (a schedule that comes back to it, a second
    stage from the top): only the loop's first step is the kit's to force. A pipeline that keeps no timestep (None:
    Helios Pyramid's) is left to raise as it does without the kit."""
    first = {"t": None, "moved": False}

    def current():
        t = pipe.current_timestep
        if t is None or first["moved"]:
            return t
        if first["t"] is None:
            first["t"] = t
        if bool(t == first["t"]):
            return 1000
        first["moved"] = True
        return t
    return current


def _half(_module) -> float:
    return 0.5


def _pyramid(pipe, steps: int, guidance: str, options: dict):
    from diffusers import PyramidAttentionBroadcastConfig

    defaults = dict(spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 1001),
                    current_timestep_callback=lambda: pipe.current_timestep)
    return PyramidAttentionBroadcastConfig(**dict(defaults, **options))


def _mag(pipe, steps: int, guidance: str, options: dict):
    import torch
    from diffusers import MagCacheConfig

    defaults = dict(threshold=0.5, max_skip_steps=2, retention_ratio=0.2, num_inference_steps=steps,
                    mag_ratios=torch.ones(steps))
    return MagCacheConfig(**dict(defaults, **options))


def _taylorseer(pipe, steps: int, guidance: str, options: dict):
    from diffusers import TaylorSeerCacheConfig

    return TaylorSeerCacheConfig(**dict(dict(cache_interval=2, disable_cache_before_step=2, max_order=1), **options))


def _sea(pipe, steps: int, guidance: str, options: dict):
    from diffusers import SeaCacheConfig

    return SeaCacheConfig(**dict(dict(threshold=0.8, retention_steps=1, cache_end_steps=1), **options))


def _text_kv(pipe, steps: int, guidance: str, options: dict):
    from diffusers import TextKVCacheConfig

    return TextKVCacheConfig(**options)


#: variant name -> (pipeline, steps, guidance, options) -> the diffusers cache config (`guidance`: how the pipeline
#: runs classifier-free guidance, `spec.GUIDANCE`).
CACHES = {
    "first-block-cache": _first_block, "faster-cache": _faster, "pyramid-attention-broadcast": _pyramid,
    "mag-cache": _mag, "taylorseer-cache": _taylorseer, "sea-cache": _sea, "text-kv-cache": _text_kv,
}


class Refused(Exception):
    """diffusers' `enable_cache` refused this cache on this transformer (its words in the message)."""


def enable(pipe, name: str, steps: int, guidance: str, options: dict) -> None:
    """Enable cache `name` on the pipeline's transformer; `Refused` where diffusers raises on it."""
    try:
        pipe.transformer.enable_cache(CACHES[name](pipe, steps, guidance, options))
    except Exception as exc:
        raise Refused(f"diffusers refuses {name} on {type(pipe.transformer).__name__}: {type(exc).__name__}: {exc}") \
            from exc
    if name == "sea-cache":
        _count_reuses(pipe.transformer)


def _count_reuses(transformer) -> None:
    """Tally SeaCache's calls and the calls it reused (`_sea_reuses` on the transformer: [calls, reused]), read off its
    leader block: the leader hook marks a reuse (`skip_remaining`) in the call's state, which the root hook clears
    only once the call is done, so a forward hook on the leader block reads it. No leader (Cosmos 3's stack
    boundary): no tally, and `inert` reads the warnings alone."""
    leader = next((m for m in transformer.modules()
                   if getattr(m, "_diffusers_hook", None) is not None
                   and m._diffusers_hook.get_hook("sea_cache_leader_block") is not None), None)
    if leader is None:
        return
    hook = leader._diffusers_hook.get_hook("sea_cache_leader_block")
    tally = transformer._sea_reuses = [0, 0]

    def read(module, args, output):
        if hook.state_manager._context is not None:
            tally[0] += 1
            tally[1] += bool(hook.state_manager.get_state().skip_remaining)
    leader.register_forward_hook(read)


class Inert(Exception):
    """The cache ran on one device and diffusers kept it off (its own words in the message)."""


def inert(pipe, name: str) -> None:
    """`Inert` where diffusers ran this cache fail-open on the pipeline's last run and it reused on no call: SeaCache's
    root hook keeps the warnings it gave, once each, and some cover one call only (a step out of order, a hit without
    history, a call outside any context), so a warning alone does not say the cache was off; the reuse tally does."""
    registry = getattr(pipe.transformer, "_diffusers_hook", None)
    root = registry.get_hook("sea_cache_root") if registry is not None and name == "sea-cache" else None
    shared = getattr(root, "shared_state", None)
    said = sorted(m for m in getattr(shared, "_warned_messages", ()) if "fail-open" in m or "running full" in m)
    calls, reused = getattr(pipe.transformer, "_sea_reuses", (None, 0))
    if said and not reused:
        on = "" if calls is None else f" (it reused on none of {calls} calls)"
        raise Inert(f"diffusers' {type(pipe).__name__} runs {name} off on one device{on}: {said[0]}")
