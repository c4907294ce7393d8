"""Which attention backend a case runs, the faults planted in it, and the kit's own CPU op for ring.

- `choose()`: diffusers' own backend wherever one can run the layout on the device (`native` for TP and
  Ulysses, on CPU too); the kit's op only where none can (ring on CPU: diffusers' only CPU backend,
  "native", refuses `return_lse=True`, which ring's merge needs).
- `fault_scope()`: plants one of `FAULTS` (negative controls) in whichever backend runs: two ring bugs
  in the op pair handed to the library's templated ring code, and a backend that ignores the
  context-parallel config it is handed (always, or only when no gradient is recorded).
- `forward_op` / `backward_op`: the kit's op pair, in the library's (B, S, H, D) layout with LSE as
  (B, S, H) float32. Both compute in float32 whatever the input dtype (bf16 in, bf16 out; LSE always
  float32), so a bf16 result is the float32 one rounded once. (Under ring, diffusers casts the merged
  output to the input dtype before the backward reads it.) `cpu_lse_attention()` registers them under
  `BACKEND` and makes it the active backend, only inside a `with` block.

The registry and the templated machinery are diffusers' private state, reached only through `library`.
"""

from __future__ import annotations

import contextlib
import enum
import math

import torch

BACKEND = "paracheck_cpu_lse"
FAULTS = ("stale-kv-backward", "drop-ring-merge", "ignore-cp-config")


class _Name(str, enum.Enum):
    # The registry keys backends by enum member and reads `.value`; diffusers' own enum cannot grow a
    # member, so ours is a separate str-enum. Consequence: `attention_backend(...)`,
    # `set_attention_backend(...)` and a processor's explicit `_attention_backend` cannot name it, since
    # they coerce through `AttentionBackendName`; only the active-backend route reaches it.
    CPU_LSE = BACKEND


# -- the math -----------------------------------------------------------------------------------


def _bias(attn_mask, dtype):
    """SDPA's mask convention as an additive float bias: bool True attends, float is added."""
    if attn_mask is None:
        return None
    if attn_mask.dtype == torch.bool:
        return torch.where(attn_mask, 0.0, float("-inf")).to(dtype)
    return attn_mask.to(dtype)


def _scale(q, scale):
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def _scores(q, k, attn_mask, scale):
    """q (B, Sq, H, D), k (B, Sk, H, D) -> float32 scores (B, H, Sq, Sk), mask broadcast as SDPA does."""
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * _scale(q, scale)
    bias = _bias(attn_mask, s.dtype)
    return s if bias is None else s + bias


def _probs(s, lse):
    # A row that sees no key has lse = -inf; subtracting 0 there keeps its probabilities 0, not NaN.
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(s - safe.unsqueeze(-1))


def attend(query, key, value, attn_mask=None, scale=None):
    """Attention in float32: (out in the query's dtype (B, Sq, H, D), lse float32 (B, Sq, H)).

    Differentiable with plain autograd; rows with no visible key give out 0 and lse -inf."""
    out, lse = _attend_fp32(query, key, value, attn_mask, scale)
    return out.to(query.dtype), lse


def _attend_fp32(query, key, value, attn_mask, scale):
    s = _scores(query, key, attn_mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", _probs(s, lse), value.float())
    return out, lse.transpose(1, 2).contiguous()


def _refuse(dropout_p, is_causal, enable_gqa):
    # The templated ring/Ulysses path refuses causal and GQA itself; dropout would need a shared RNG
    # across the forward and the recomputing backward, which this op does not keep.
    if dropout_p or is_causal or enable_gqa:
        raise ValueError(f"{BACKEND}: dropout_p, is_causal and enable_gqa are not supported")


# -- the op pair diffusers' templated context-parallel code calls ---------------------------------


def forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):
    """Attention over one KV chunk; saves what `backward_op` needs when `_save_ctx`."""
    _refuse(dropout_p, is_causal, enable_gqa)
    with torch.no_grad():
        out, lse = _attend_fp32(query, key, value, attn_mask, scale)
    if _save_ctx:
        # The float32 out, so a bf16 backward rounds once; the ring overrides it with its merged out,
        # which diffusers has already cast to the input dtype.
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.attn_mask, ctx.scale = attn_mask, scale
    out = out.to(query.dtype)
    return (out, lse) if return_lse else out


def backward_op(ctx, grad_out, *args, query=None, key=None, value=None, out=None, lse=None, **kwargs):
    """Gradients (dq, dk, dv) of the saved query against one KV chunk, in the inputs' dtype.

    The ring passes the visiting chunk's key/value and the ring-merged out/lse; with those, the
    chunk's probabilities are exp(scores - global lse), so per-chunk gradients sum to the exact ones.
    Ulysses passes nothing and the saved tensors are used."""
    saved = dict(zip(("query", "key", "value", "out", "lse"), ctx.saved_tensors))
    given = dict(query=query, key=key, value=value, out=out, lse=lse)
    t = {name: saved[name] if given[name] is None else given[name] for name in saved}
    return _chunk_grads(grad_out, t["query"], t["key"], t["value"], t["out"], t["lse"], ctx.attn_mask, ctx.scale)


def _chunk_grads(grad_out, q, k, v, out, lse, attn_mask, scale):
    p = _probs(_scores(q, k, attn_mask, scale), lse.float().transpose(1, 2))
    do = grad_out.float()
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, v.float())
    # Each row's softmax Jacobian term sum_j p_ij dp_ij equals dO_i . O_i over *all* chunks, which is
    # why the global (merged) out is needed and a chunk-local one would be wrong.
    delta = (do * out.float()).sum(-1).transpose(1, 2).unsqueeze(-1)
    ds = p * (dp - delta) * _scale(q, scale)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, k.float())
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.float())
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# -- planted backend faults ----------------------------------------------------------------------
# Each fault is planted in whichever backend the case runs (diffusers' own or this module's), at one of
# the two seams every context-parallel backend shares: the op pair a backend hands the library's
# templated ring/Ulysses machinery (the ring faults), and the backend function the dispatcher calls with
# the parallel config (the config faults). Single-device runs never reach either with a config.


def _drop_ring_merge(forward, backward):
    """Every visiting chunk reports lse = -inf, so the merge keeps only the rank's own chunk. Only the
    ring loop calls the forward op with `_save_ctx=False` (after its first step)."""

    def forward_op(ctx, *args, _save_ctx=True, **kwargs):
        result = forward(ctx, *args, _save_ctx=_save_ctx, **kwargs)
        if _save_ctx or not isinstance(result, tuple):
            return result
        out, lse = result
        return out, torch.full_like(lse, float("-inf"))

    return forward_op, backward


def _stale_kv_backward(forward, backward):
    """The backward ignores the visiting chunk the ring hands it and reuses the saved (local) one.

    The chunk it ignores is a view of the library's asynchronous KV all-gather; only its first use waits
    for that collective. Ignored, it would never be waited: torch keeps such a work in its registry, with
    the gather's buffers, for the life of the rank (one per ring attention call in every backward this
    control plants). So the fault waits for it, then ignores it: the bug stays in the numbers alone."""

    def backward_op(ctx, grad_out, *args, key=None, value=None, **kwargs):
        _wait_collective(key)
        _wait_collective(value)
        return backward(ctx, grad_out, *args, **kwargs)

    return forward, backward_op


def _wait_collective(tensor) -> None:
    """Wait for the functional collective whose output `tensor` views, if one is still pending."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if isinstance(tensor, AsyncCollectiveTensor):
        tensor.trigger_wait()


def _always() -> bool:
    return True


def _no_grad() -> bool:
    return not torch.is_grad_enabled()


#: fault -> wraps (forward_op, backward_op) handed to the templated CP machinery.
_OP_FAULTS = {"stale-kv-backward": _stale_kv_backward, "drop-ring-merge": _drop_ring_merge}
#: fault -> when the backend drops the parallel config it is handed (attends this rank's shard alone:
#: no all-to-all, no KV gather, no error), the shape of a kernel that bypasses the CP path.
_CONFIG_FAULTS = {"ignore-cp-config": _always, "ignore-cp-config-no-grad": _no_grad}
FAULTS = (*_OP_FAULTS, *_CONFIG_FAULTS)


@contextlib.contextmanager
def fault_scope(fault: str | None):
    """Inside the block, `fault` (one of `FAULTS`) is planted in every registered attention backend;
    None plants nothing. Enter it inside the backend's own scope, so a backend registered for the case
    is faulted too. On exit, also on error, the library is as it was."""
    from paracheck.adapters.diffusers import library

    if fault is None:
        yield
    elif fault in _OP_FAULTS:
        with library.templated_ops(_OP_FAULTS[fault]):
            yield
    elif fault in _CONFIG_FAULTS:
        when = _CONFIG_FAULTS[fault]
        with library.wrapped_backends(lambda fn: _dropping_config(fn, when)):
            yield
    else:
        raise ValueError(f"fault {fault!r}: must be None or one of {', '.join(FAULTS)}")


def _dropping_config(fn, when):
    def call(*args, **kwargs):
        if when():
            kwargs["_parallel_config"] = None
        return fn(*args, **kwargs)
    return call


# -- this module's backend and its scope -----------------------------------------------------------


def paracheck_cpu_lse(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      enable_gqa=False, return_lse=False, _parallel_config=None):
    from paracheck.adapters.diffusers.library import templated_context_parallel_attention

    # As the native backend does before SDPA: a (batch, keys) mask means "per key", not (queries, keys).
    if attn_mask is not None and attn_mask.ndim == 2 and attn_mask.shape == (query.shape[0], key.shape[1]):
        attn_mask = attn_mask[:, None, None, :]
    if _parallel_config is None:
        _refuse(dropout_p, is_causal, enable_gqa)
        out, lse = attend(query, key, value, attn_mask, scale)
        return (out, lse) if return_lse else out
    return templated_context_parallel_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
        forward_op=forward_op, backward_op=backward_op, _parallel_config=_parallel_config,
    )


@contextlib.contextmanager
def cpu_lse_attention(fault: str | None = None):
    """Inside the block, attention dispatched with no explicit backend runs `forward_op`/`backward_op`.

    That covers single-device calls and diffusers' templated ring, Ulysses and unified ring x Ulysses
    paths (whose library code runs unchanged); `fault` plants one of `FAULTS` (see `fault_scope`). On
    exit, also on error, the registry is as it was found. Processors with an explicit
    `_attention_backend` bypass the active backend and are not affected."""
    from paracheck.adapters.diffusers import library

    with library.active_attention_backend(_Name.CPU_LSE, paracheck_cpu_lse), fault_scope(fault):
        yield _Name.CPU_LSE


# -- choosing the backend a case runs ---------------------------------------------------------------

#: Backends whose forward op returns the log-sum-exp ring needs (diffusers 0.42.1; the others raise).
RING_CAPABLE = (BACKEND, "_native_cudnn", "_native_flash", "flash", "sage")
#: Tried in order for `auto` ring layouts on GPUs.
GPU_RING_ORDER = ("_native_cudnn", "_native_flash", "flash", "sage")


def choose(requested: str, device_type: str, layout) -> tuple[str | None, str | None]:
    """(the backend a case runs, None) or (None, why the case cannot run). `auto`: the library's own
    `native` wherever the layout has no ring; for ring, on CPU this module's op (no diffusers backend
    returns the log-sum-exp there), on accelerators the first usable backend that returns it."""
    from paracheck.adapters.diffusers import library

    if requested == "auto":
        if layout.ring == 1:
            return "native", None
        if device_type == "cpu":
            return BACKEND, None
        usable = [n for n in GPU_RING_ORDER if library.attention_backend_problem(n) is None]
        if usable:
            return usable[0], None
        return None, (f"ring needs an attention backend that returns the log-sum-exp; none of "
                      f"{', '.join(GPU_RING_ORDER)} is usable here")
    if requested == BACKEND:
        return BACKEND, None
    problem = library.attention_backend_problem(requested)
    if problem:
        return None, f"--attention-backend {requested}: {problem}"
    if layout.ring > 1 and requested not in RING_CAPABLE:
        return None, f"--attention-backend {requested} returns no log-sum-exp, which ring attention needs"
    return requested, None


@contextlib.contextmanager
def scope(name: str, fault: str | None = None):
    """Run attention with backend `name` inside the block, `fault` (one of `FAULTS`) planted in it."""
    from paracheck.adapters.diffusers import library

    if name == BACKEND:
        with cpu_lse_attention(fault):
            yield
    else:
        with library.named_attention_backend(name), fault_scope(fault):
            yield
