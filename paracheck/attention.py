"""A plain-torch attention that returns its log-sum-exp, registered as a scoped diffusers backend so ring runs on gloo.

diffusers' ring attention merges per-chunk results with their log-sum-exp (LSE); its only CPU backend
("native") refuses `return_lse=True`, so without this module every ring layout is skipped on CPU. Here:

- `forward_op` / `backward_op`: the op pair diffusers' templated ring and Ulysses code calls, in the
  library's (B, S, H, D) layout with LSE as (B, S, H) float32. Both compute in float32 whatever the
  input dtype (bf16 in, bf16 out; LSE always float32), so a bf16 result is the float32 one rounded once.
  (Under ring, diffusers casts the merged output to the input dtype before the backward reads it.)
- `cpu_lse_attention()`: registers the pair under `BACKEND` and makes it the active backend, only
  inside a `with` block; `fault=` plants one of `FAULTS` (negative controls): two ring-only bugs, and a
  backend that ignores the context-parallel config it is handed.

The registry it plugs into is diffusers' private state, reached only through `library`.
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


# -- planted ring bugs ---------------------------------------------------------------------------
# Both key off what only the ring loop does: it calls the forward with `_save_ctx=False` after its
# first step, and it alone hands the backward a visiting key/value. Ulysses-only and single-device
# runs never hit either, so the faults are inert at ring degree 1.


def _drop_ring_merge_forward_op(ctx, *args, _save_ctx=True, **kwargs):
    """Every visiting chunk reports lse = -inf, so the merge keeps only the rank's own chunk."""
    result = forward_op(ctx, *args, _save_ctx=_save_ctx, **kwargs)
    if _save_ctx or not isinstance(result, tuple):
        return result
    out, lse = result
    return out, torch.full_like(lse, float("-inf"))


def _stale_kv_backward_op(ctx, grad_out, *args, key=None, value=None, **kwargs):
    """Ignores the visiting chunk and reuses the saved (first, local) one at every ring step."""
    return backward_op(ctx, grad_out, *args, **kwargs)


def _ops(fault):
    if fault in (None, "ignore-cp-config"):
        return forward_op, backward_op
    if fault == "stale-kv-backward":
        return forward_op, _stale_kv_backward_op
    if fault == "drop-ring-merge":
        return _drop_ring_merge_forward_op, backward_op
    raise ValueError(f"fault {fault!r}: must be None or one of {', '.join(FAULTS)}")


# -- the backend and its scope --------------------------------------------------------------------


def _backend(fault):
    forward, backward = _ops(fault)
    # The shape of a kernel that bypasses the library's context-parallel path: handed the CP config, it
    # attends this rank's own shard (no all-to-all, no KV gather) and raises nothing.
    honours_cp = fault != "ignore-cp-config"

    def paracheck_cpu_lse(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                          enable_gqa=False, return_lse=False, _parallel_config=None):
        from .library import templated_context_parallel_attention

        # As the native backend does before SDPA: a (batch, keys) mask means "per key", not (queries, keys).
        if attn_mask is not None and attn_mask.ndim == 2 and attn_mask.shape == (query.shape[0], key.shape[1]):
            attn_mask = attn_mask[:, None, None, :]
        if _parallel_config is None or not honours_cp:
            _refuse(dropout_p, is_causal, enable_gqa)
            out, lse = attend(query, key, value, attn_mask, scale)
            return (out, lse) if return_lse else out
        return templated_context_parallel_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
            forward_op=forward, backward_op=backward, _parallel_config=_parallel_config,
        )

    return paracheck_cpu_lse


@contextlib.contextmanager
def cpu_lse_attention(fault: str | None = None):
    """Inside the block, attention dispatched with no explicit backend runs `forward_op`/`backward_op`.

    That covers single-device calls and diffusers' templated ring, Ulysses and unified ring x Ulysses
    paths (whose library code runs unchanged). `fault` plants a ring-only bug, "stale-kv-backward"
    (forward exact, ring gradients wrong; diffusers #14265's shape) or "drop-ring-merge" (ring forward
    attends only the local KV chunk), or "ignore-cp-config" (every context-parallel call attends this
    rank's shard alone, Ulysses and ring). On exit, also on error, the registry is as it was found.
    Processors with an explicit `_attention_backend` bypass the active backend and are not affected."""
    from . import library

    with library.active_attention_backend(_Name.CPU_LSE, _backend(fault)):
        yield _Name.CPU_LSE


# -- choosing the backend a case runs ---------------------------------------------------------------

#: Backends whose forward op returns the log-sum-exp ring needs (diffusers 0.42.1; the others raise).
RING_CAPABLE = (BACKEND, "_native_cudnn", "_native_flash", "flash", "sage")
#: Tried in order for `auto` ring layouts on GPUs.
GPU_RING_ORDER = ("_native_cudnn", "_native_flash", "flash", "sage")


def choose(requested: str, device_type: str, layout) -> tuple[str | None, str | None]:
    """(the backend a case runs, None) or (None, why the case cannot run). `auto`: this module's op on
    CPU; on accelerators the library's default, or for ring the first usable backend returning the LSE."""
    from . import library

    if requested == "auto":
        if device_type == "cpu":
            return BACKEND, None
        if layout.ring == 1:
            return "native", None
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
    """Run attention with backend `name` inside the block (`fault` only for this module's op)."""
    from . import library

    if name == BACKEND:
        with cpu_lse_attention(fault):
            yield
    else:
        with library.named_attention_backend(name):
            yield
