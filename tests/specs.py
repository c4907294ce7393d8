"""Factories the kit's own tests run: good ones, and deliberately broken ones (failure modes)."""

import contextlib
import functools
import os

import torch


def flux_spec():
    from paracheck.fixtures import flux

    return flux()


def ltx_short_text():
    """LTX with fewer text tokens than video tokens: diffusers 0.42's Ulysses backward raises."""
    from paracheck.fixtures import ltx

    cls, init, inputs = ltx()
    inputs["encoder_hidden_states"] = inputs["encoder_hidden_states"][:, :8]
    return cls, init, inputs


def ltx2_cross_modal():
    """LTX2 with its audio<->video cross-attentions on: diffusers 0.42.1's `_cp_plan` leaves
    `cross_attn_rope` unsplit, so every CP forward raises (huggingface/diffusers#14316)."""
    from paracheck.fixtures import ltx2

    cls, init, inputs = ltx2()
    return cls, init, dict(inputs, isolate_modalities=False)


def no_heads():
    """A TP-capable model whose head count is not an integer, so no layout with TP can be fitted."""
    cls, init, inputs = flux_spec()
    return cls, dict(init, num_attention_heads=None), inputs


def raises_everywhere():
    raise RuntimeError("this factory is broken on purpose")


def wrong_shape():
    return ("not", "a spec")


def rank2_dies():
    """Rank 2 is killed by a signal while the others start the case."""
    import signal

    if os.environ.get("RANK") == "2":
        os.kill(os.getpid(), signal.SIGKILL)
    return flux_spec()


def rank2_dies_after_a_progress_bar():
    """Every rank draws a tqdm bar, as transformers' loading does, then rank 2 is killed by a signal."""
    import signal

    from tqdm import tqdm

    for _ in tqdm(range(2), disable=False):
        pass
    if os.environ.get("RANK") == "2":
        os.kill(os.getpid(), signal.SIGKILL)
    return flux_spec()


def rank1_hangs():
    """Rank 1 enters a collective no peer joins, so the world hangs inside the case."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() == 1:
        dist.all_reduce(torch.ones(1))
    return flux_spec()


def raises_on_ranks_2_3():
    """Flux whose parallel forward raises on ranks 2 and 3 only, so ranks 0-1 wait in a collective."""
    from diffusers import FluxTransformer2DModel

    class FluxRaisesOnTwoRanks(FluxTransformer2DModel):
        def forward(self, *args, **kwargs):
            import torch.distributed as dist

            if dist.is_initialized() and dist.get_rank() in (2, 3) and getattr(self, "_parallel_config", None):
                raise RuntimeError("planted: ranks 2-3 fail in the parallel forward")
            return super().forward(*args, **kwargs)

    _, init, inputs = flux_spec()
    return FluxRaisesOnTwoRanks, init, inputs


def flux_fixed_ring():
    """Flux with the upstream fix for the ring backward rotation applied by hand, for the life of this
    rank process: the known failure declared for r4 must then show as xpass (the entry is real)."""
    if _on_a_rank() and not _KEPT:
        fix = reversed_ring_rotation()
        fix.__enter__()
        _KEPT.append(fix)  # a dropped context manager would be collected, and its exit undo the fix
    return flux_spec()


_KEPT = []


def _on_a_rank() -> bool:
    """Whether this process is one of a run's ranks: the specs that bend a library do it there only, so the
    launcher (a test's own process, for runs in process) keeps the library as it ships."""
    import torch.distributed as dist

    return "RANK" in os.environ and dist.is_initialized()


def flux_native_ignores_cp():
    """Flux, with diffusers' own native backend bent for the life of this rank process (and only there): handed the CP
    config, it drops it and attends this rank's shard alone. What a default run must catch."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    backends = _AttentionBackendRegistry._backends
    native = backends[AttentionBackendName.NATIVE]
    if _on_a_rank() and not getattr(native, "planted", False):
        def ignores_cp(*args, **kwargs):
            kwargs["_parallel_config"] = None
            return native(*args, **kwargs)

        ignores_cp.planted = True
        backends[AttentionBackendName.NATIVE] = ignores_cp
    return flux_spec()


@functools.cache
def _batch_mask_bug_class():
    from diffusers import QwenImageTransformer2DModel

    class BatchMaskBugQwenImage(QwenImageTransformer2DModel):
        """Parallel runs only: scales the output by 1.05 when two or more samples come with a padded mask."""

        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            mask = kwargs.get("encoder_hidden_states_mask")
            planted = (getattr(self, "_parallel_config", None) is not None and mask is not None
                       and mask.shape[0] >= 2 and bool((mask == 0).any()))
            return (out[0] * 1.05, *out[1:]) if planted else out

    return BatchMaskBugQwenImage


def batch_mask_bug(variant="base", shape=None):
    """QwenImage whose parallel output is wrong only for a batch of two or more with a padded text mask: what
    `paracheck explore` must find and shrink to exactly that (tests/explore/test_explore.py)."""
    from paracheck.fixtures import qwenimage

    _, init, inputs = qwenimage(variant, shape)
    return _batch_mask_bug_class(), init, inputs


def _batch_mask_space():
    from paracheck.domain.shapes import Axis, Space

    # Image tokens 2 x width and text lengths are even, so 2 ranks always divide them.
    return Space(dict(height=Axis(2, 2, 2, 2), width=Axis(2, 3, 1, 3), text=Axis(4, 4, 2, 6, step=2)), masks=True)


batch_mask_bug.space = _batch_mask_space()


def llama_drops_position_ids(variant="base", shape=None):
    """The transformers llama fixture whose parallel forward drops `position_ids` (a training wrapper that passes
    on ids, mask and labels only), bent on the ranks alone: packed rows then attend across their documents.
    Only a row of two or more documents shows it, so `paracheck explore` must draw and shrink to one
    (tests/adapters/transformers/test_explore_transformers.py)."""
    if _on_a_rank():
        _drop_parallel_position_ids()
    return "llama", shape


def _drop_parallel_position_ids():
    _bend_parallel_llama(lambda kwargs: kwargs.pop("position_ids", None))


def _bend_parallel_llama(bend):
    """Wrap `LlamaForCausalLM.forward` once per process: `bend(kwargs)` runs first for a model loaded with
    `distributed_config` (the parallel one); the single-process reference runs as shipped."""
    from transformers import LlamaForCausalLM

    forward = LlamaForCausalLM.forward
    if getattr(forward, "planted", False):
        return

    @functools.wraps(forward)
    def bent(self, *args, **kwargs):
        if getattr(self, "_mesh_manager", None) is not None:
            bend(kwargs)
        return forward(self, *args, **kwargs)

    bent.planted = True
    LlamaForCausalLM.forward = bent


def _small_token_space():
    from paracheck.domain.shapes import Axis, Space

    return Space(dict(tokens=Axis(4, 4, 2, 6)), masks=True, timesteps=False, batch=2, token_rows=True)


llama_drops_position_ids.library = "transformers"
llama_drops_position_ids.space = _small_token_space()


# -- the upstream fix for the ring backward's rotation, applied by hand (tests only) -------------------


class _ReversedRotation:
    """Stands in for torch's functional-collectives module inside diffusers' attention_dispatch: the
    +1 rotation the ring backward asks of `permute_tensor` becomes -1; everything else passes through."""

    def __init__(self, funcol):
        self._funcol = funcol

    def __getattr__(self, name):
        return getattr(self._funcol, name)

    def permute_tensor(self, tensor, src_dst, group, *args, **kwargs):
        n = len(src_dst)
        if list(src_dst) == [(r + 1) % n for r in range(n)]:
            src_dst = [(r - 1) % n for r in range(n)]
        return self._funcol.permute_tensor(tensor, src_dst, group, *args, **kwargs)


@contextlib.contextmanager
def reversed_ring_rotation():
    """diffusers 0.42.1's `TemplatedRingAttention.backward` passes each rank's KV-gradient
    accumulator to rank + 1 while step i computes the gradient of chunk rank + i, so an accumulator
    meets the wrong chunks once the ring degree exceeds 2. Passing it to rank - 1 instead (the fix,
    applied here by hand) keeps each accumulator on the rank that is computing its chunk. Exists only
    so a test can prove that known failure is real."""
    from paracheck.adapters.diffusers import library

    with library.attention_collectives(_ReversedRotation):
        yield


def class_not_in_this_diffusers():
    """A bundled-fixture-style factory whose diffusers class this install lacks."""
    from paracheck.domain.case import FixtureUnavailable

    raise FixtureUnavailable("fixture gone: diffusers cannot provide its model class (no NoSuchTransformer)")


def llama_raises_on_ranks_2_3(variant="base", shape=None):
    """The transformers llama fixture whose parallel forward raises on ranks 2 and 3 only, so ranks 0-1 wait
    in a collective for peers that left it."""
    import torch.distributed as dist

    if _on_a_rank() and dist.get_rank() in (2, 3):
        _raise_in_parallel_forward()
    return "llama", shape


def _raise_in_parallel_forward():
    def raises(kwargs):
        raise RuntimeError("planted: the parallel forward raises on this rank")

    _bend_parallel_llama(raises)


llama_raises_on_ranks_2_3.library = "transformers"


def llama_packed_drops_position_ids(variant="base", shape=None):
    """`llama_drops_position_ids` on two packed rows of two documents each, for `run --spec`."""
    from paracheck.domain.shapes import Shape

    shape = shape or Shape(batch=2, lengths=(("tokens", 12),), documents=((5, 7), (6, 6)), token_rows=True)
    return llama_drops_position_ids(variant, shape)


llama_packed_drops_position_ids.library = "transformers"
