"""The CPU LSE attention: its math against SDPA and logsumexp, its ring contract, its registry scope,
and (slow) diffusers' own ring / Ulysses code running on it over gloo.

Tolerances are measured (float64 reference, CPU): float32 forward, LSE and gradients agree to <= 1.6e-6
absolute on shapes up to S=128, D=64 with values of order 1 (SDPA in float32 itself is off by 1.6e-6
there), so 1e-5 relative to max(1, |ref|) leaves 6x headroom. bf16 results are float32 results
rounded once, so each element is within half a bf16 ulp (<= 2^-8 |ref|) of the reference.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from paracheck.adapters.diffusers.attention import BACKEND, FAULTS, attend, backward_op, cpu_lse_attention, forward_op

FP32_TOL = 1e-5
BF16_HALF_ULP = 2.0 ** -8  # bf16 keeps 8 significant bits


class Ctx:
    """The part of an autograd ctx the ops use."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def close(actual, expected, tol=FP32_TOL):
    scale = max(1.0, float(expected.abs().max()))
    return float((actual.double() - expected.double()).abs().max()) <= tol * scale


def sdpa(q, k, v, mask=None, scale=None):
    """SDPA taking and returning diffusers' (B, S, H, D) layout."""
    out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


def explicit_lse(q, k, mask=None, scale=None):
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    return torch.logsumexp(s, dim=-1).transpose(1, 2)


@st.composite
def problems(draw, dtype=torch.float32):
    b, sq, sk, h = draw(st.integers(1, 2)), draw(st.integers(1, 12)), draw(st.integers(1, 12)), draw(st.integers(1, 3))
    d = draw(st.sampled_from([1, 4, 8, 16]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q, k, v, grad = (torch.randn(b, s, h, d, generator=g).to(dtype) for s in (sq, sk, sk, sq))
    kind = draw(st.sampled_from(["none", "bool", "additive"]))
    mask = None
    if kind == "bool":
        mask = torch.rand(b, 1, sq, sk, generator=g) > 0.4
        mask[..., 0] = True  # every query sees a key: SDPA's fully-masked rows are NaN, ours are 0
    elif kind == "additive":
        mask = torch.randn(b, 1, 1, sk, generator=g).to(dtype)
    scale = draw(st.sampled_from([None, 0.3]))
    return q, k, v, grad, mask, scale


def ops(q, k, v, grad, mask, scale):
    ctx = Ctx()
    out, lse = forward_op(ctx, q, k, v, mask, 0.0, False, scale, False, True)
    return out, lse, backward_op(ctx, grad)


def sdpa_grads(q, k, v, grad, mask, scale, dtype=None):
    leaves = [x.to(dtype or x.dtype).requires_grad_() for x in (q, k, v)]
    out = sdpa(*leaves, mask if mask is None or mask.dtype == torch.bool else mask.to(leaves[0].dtype), scale)
    out.backward(grad.to(out.dtype))
    return out.detach(), [x.grad for x in leaves]


# -- the math ------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(problems())
def test_float32_forward_backward_match_sdpa_and_logsumexp(problem):
    q, k, v, grad, mask, scale = problem
    out, lse, grads = ops(q, k, v, grad, mask, scale)
    ref_out, ref_grads = sdpa_grads(q, k, v, grad, mask, scale)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    assert close(out, ref_out)
    assert close(lse, explicit_lse(q, k, mask, scale))
    for mine, ref in zip(grads, ref_grads):
        assert close(mine, ref)


@settings(max_examples=40, deadline=None)
@given(problems(dtype=torch.bfloat16))
def test_bf16_is_the_float32_result_rounded_once(problem):
    q, k, v, grad, mask, scale = problem
    out, lse, grads = ops(q, k, v, grad, mask, scale)
    ref_out, ref_grads = sdpa_grads(q, k, v, grad, mask, scale, dtype=torch.float64)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert all(g.dtype == torch.bfloat16 for g in grads)
    for name, mine, ref in zip(("out", "dq", "dk", "dv"), [out, *grads], [ref_out, *ref_grads]):
        bound = BF16_HALF_ULP * ref.abs() + FP32_TOL * max(1.0, float(ref.abs().max()))
        assert bool(((mine.double() - ref).abs() <= bound).all()), name
    assert close(lse, explicit_lse(q, k, mask, scale))
    # and as close to torch's own bf16 SDPA as the kit's bf16 tolerance asks
    sdpa_out, _ = sdpa_grads(q, k, v, grad, mask, scale)
    assert close(out, sdpa_out, tol=2e-2)


def test_a_query_that_sees_no_key_gives_zeros_not_nan():
    q, k, v, grad = (torch.randn(1, 3, 2, 4) for _ in range(4))
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    mask[:, :, 1] = False
    out, lse, grads = ops(q, k, v, grad, mask, None)
    assert torch.isneginf(lse[:, 1]).all() and (out[:, 1] == 0).all()
    assert all(torch.isfinite(g).all() for g in grads) and (grads[0][:, 1] == 0).all()


def test_attend_is_differentiable_by_autograd():
    q, k, v = (torch.randn(2, 5, 2, 8, requires_grad=True) for _ in range(3))
    out, _ = attend(q, k, v)
    out.sum().backward()
    _, ref = sdpa_grads(q.detach(), k.detach(), v.detach(), torch.ones(2, 5, 2, 8), None, None)
    assert all(close(x.grad, r) for x, r in zip((q, k, v), ref))


# -- the ring contract: chunks merged by their LSE are the whole ----------------------------------


@settings(max_examples=40, deadline=None)
@given(problems(), st.integers(1, 11))
def test_one_ring_step_merged_by_hand_equals_attention_over_all_keys(problem, cut):
    q, k, v, grad, mask, scale = problem
    if mask is not None and mask.dtype == torch.bool:
        mask = None  # a per-query bool mask may blank a whole chunk for a row; covered above
    cut = min(cut, k.shape[1] - 1)
    if cut < 1:
        return
    chunks = [(k[:, :cut], v[:, :cut], None if mask is None else mask[..., :cut]),
              (k[:, cut:], v[:, cut:], None if mask is None else mask[..., cut:])]
    parts = [forward_op(Ctx(), q, kc, vc, mc, 0.0, False, scale, False, True) for kc, vc, mc in chunks]
    (o1, l1), (o2, l2) = parts
    lse = torch.logaddexp(l1, l2)
    out = torch.exp(l1 - lse)[..., None] * o1 + torch.exp(l2 - lse)[..., None] * o2
    full_out, full_lse, full_grads = ops(q, k, v, grad, mask, scale)
    assert close(out, full_out) and close(lse, full_lse)

    # The ring backward: each chunk's gradients from the merged out/lse, dq summed, dk/dv per chunk.
    dq, dks, dvs = 0, [], []
    for kc, vc, mc in chunks:
        ctx = Ctx()
        forward_op(ctx, q, kc, vc, mc, 0.0, False, scale, False, True)
        gq, gk, gv = backward_op(ctx, grad, out=out, lse=lse)
        dq, dks, dvs = dq + gq, dks + [gk], dvs + [gv]
    assert close(dq, full_grads[0])
    assert close(torch.cat(dks, 1), full_grads[1]) and close(torch.cat(dvs, 1), full_grads[2])


def test_backward_uses_the_chunk_it_is_handed_over_the_saved_one():
    q, k, v, grad = (torch.randn(1, 4, 2, 4) for _ in range(4))
    other_k, other_v = torch.randn(1, 4, 2, 4), torch.randn(1, 4, 2, 4)
    ctx = Ctx()
    out, lse = forward_op(ctx, q, k, v, return_lse=True)
    moved = backward_op(ctx, grad, key=other_k, value=other_v, out=out, lse=lse)
    fresh = Ctx()
    forward_op(fresh, q, other_k, other_v)
    assert all(torch.equal(a, b) for a, b in zip(moved, backward_op(fresh, grad, out=out, lse=lse)))


# -- the planted faults, seen from the op: each only bends what the ring alone does -----------------


def test_drop_ring_merge_hides_only_visiting_chunks():
    from paracheck.adapters.diffusers.attention import _OP_FAULTS

    forward, _ = _OP_FAULTS["drop-ring-merge"](forward_op, backward_op)
    q, k, v = (torch.randn(1, 4, 2, 4) for _ in range(3))
    first = forward(Ctx(), q, k, v, None, 0.0, False, None, False, True, _save_ctx=True)
    later = forward(Ctx(), q, k, v, None, 0.0, False, None, False, True, _save_ctx=False)
    assert torch.isfinite(first[1]).all() and torch.isneginf(later[1]).all()
    assert torch.equal(first[0], later[0])


def test_stale_kv_backward_ignores_only_the_visiting_chunk():
    from paracheck.adapters.diffusers.attention import _OP_FAULTS

    _, backward = _OP_FAULTS["stale-kv-backward"](forward_op, backward_op)
    q, k, v, grad = (torch.randn(1, 4, 2, 4) for _ in range(4))
    ctx = Ctx()
    forward_op(ctx, q, k, v)
    stale = backward(ctx, grad, key=torch.randn(1, 4, 2, 4), value=torch.randn(1, 4, 2, 4))
    assert all(torch.equal(a, b) for a, b in zip(stale, backward_op(ctx, grad)))


# -- the registry: scoped, and left exactly as found ----------------------------------------------


def registry():
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    return _AttentionBackendRegistry


def registry_state():
    """Every container and value the registry class holds, copied."""
    state = {}
    for name, value in vars(registry()).items():
        if isinstance(value, (dict, set)):
            state[name] = type(value)(value)
        elif not callable(value) and not isinstance(value, (classmethod, staticmethod)) and not name.startswith("__"):
            state[name] = value
    return state


def ours_registered():
    return any(getattr(key, "value", key) == BACKEND for key in registry()._backends)


def test_importing_the_module_registers_nothing():
    assert not ours_registered()
    assert registry()._active_backend.value != BACKEND


def test_the_block_activates_the_backend_and_leaves_the_registry_as_found():
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    before = registry_state()
    q, k, v = (torch.randn(1, 3, 2, 4) for _ in range(3))
    with cpu_lse_attention() as key:
        assert registry()._active_backend is key and key.value == BACKEND
        assert registry()._is_context_parallel_available(key)
        out, lse = dispatch_attention_fn(q, k, v, attention_kwargs={"return_lse": True})
        assert close(out, sdpa(q, k, v)) and lse.shape == (1, 3, 2)
    assert registry_state() == before and not ours_registered()
    with pytest.raises(ValueError, match="return_lse"):
        dispatch_attention_fn(q, k, v, attention_kwargs={"return_lse": True})


def test_the_registry_is_restored_when_the_block_raises():
    before = registry_state()
    with pytest.raises(RuntimeError, match="boom"):
        with cpu_lse_attention(fault="drop-ring-merge"):
            raise RuntimeError("boom")
    assert registry_state() == before


def templated():
    import diffusers.models.attention_dispatch as dispatch

    return dispatch._templated_context_parallel_attention


def test_nested_blocks_restore_the_outer_registration():
    before, machinery = registry_state(), templated()
    with cpu_lse_attention():
        outer = registry_state()
        with cpu_lse_attention(fault="stale-kv-backward"):
            assert templated() is not machinery
        assert registry_state() == outer and templated() is machinery
    assert registry_state() == before


@pytest.mark.parametrize("fault", FAULTS)
def test_faults_reach_diffusers_own_backend_and_are_undone(fault):
    """A fault is planted in whichever backend runs, diffusers' native included: the ring faults in the
    op pair handed to the templated machinery, the config faults in the backend function itself."""
    from paracheck.adapters.diffusers.attention import _OP_FAULTS, scope

    before, machinery = registry_state(), templated()
    native = registry()._backends[registry()._active_backend]
    with scope("native", fault):
        if fault in _OP_FAULTS:
            assert templated() is not machinery
        else:
            assert registry()._backends[registry()._active_backend] is not native
    assert registry_state() == before and templated() is machinery


def test_an_unknown_fault_is_refused_before_the_registry_is_touched():
    before = registry_state()
    with pytest.raises(ValueError, match="stale-kv-backward, drop-ring-merge"):
        with cpu_lse_attention(fault="typo"):
            pass
    assert registry_state() == before


@pytest.mark.parametrize("backend", ("native", BACKEND))
@pytest.mark.parametrize("fault", (None,) + FAULTS)
def test_faults_do_nothing_without_context_parallelism(fault, backend):
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    from paracheck.adapters.diffusers.attention import scope

    q, k, v = (torch.randn(1, 5, 2, 4, requires_grad=True) for _ in range(3))
    mask = torch.tensor([[True, True, False, True, True]])  # the (batch, keys) form processors pass
    with scope(backend, fault):
        out = dispatch_attention_fn(q, k, v, attn_mask=mask)
        with torch.no_grad():
            out_no_grad = dispatch_attention_fn(q, k, v, attn_mask=mask)
    assert close(out, sdpa(q, k, v, mask[:, None, None, :])) and close(out_no_grad, out)


# -- slow: diffusers' own templated ring / Ulysses code on a gloo world ---------------------------


def _by_layout(results):
    return {(r["ring"], r["ulysses"], r["fault"], r["fixed"], r["mask"]): r for r in results}


def exact(r):
    return "raised" not in r and all(r[n] <= FP32_TOL for n in ("out", "dq", "dk", "dv"))


@pytest.mark.slow
def test_two_ranks_ring_is_exact_and_its_faults_are_caught():
    from tests import ring_harness

    got = _by_layout(ring_harness.run(2, [
        dict(ring=2), dict(ulysses=2),
        dict(ring=2, fault="stale-kv-backward"), dict(ring=2, fault="drop-ring-merge"),
        dict(ulysses=2, fault="stale-kv-backward"), dict(ulysses=2, fault="drop-ring-merge"),
    ]))
    assert exact(got[2, 1, None, False, False]) and exact(got[1, 2, None, False, False])
    stale, dropped = got[2, 1, "stale-kv-backward", False, False], got[2, 1, "drop-ring-merge", False, False]
    assert stale["out"] <= FP32_TOL and min(stale["dk"], stale["dv"]) > 1e-2  # forward exact, grads not
    assert dropped["out"] > 1e-2
    assert exact(got[1, 2, "stale-kv-backward", False, False]) and exact(got[1, 2, "drop-ring-merge", False, False])
    # The faults bend the numbers only: no collective is left un-waited (a stale-kv backward that ignored
    # the visiting chunk left the library's KV all-gather in torch's registry for the life of the rank).
    assert all(r.get("unwaited") == 0 for r in got.values()), {k: r.get("unwaited") for k, r in got.items()}


@pytest.mark.slow
def test_four_ranks_known_ring_failures_are_real():
    """diffusers 0.42.1: ring degree 4 gets key/value gradients wrong (the accumulator rotation), and
    reversing that rotation by hand fixes them; a key mask is not rotated with its keys (wrong forward)
    and is not gathered by the unified ring x Ulysses path (raises). docs/upstream/ has the details."""
    from tests import ring_harness

    got = _by_layout(ring_harness.run(4, [
        dict(ring=4), dict(ring=4, fixed=True), dict(ring=2, ulysses=2), dict(ulysses=4),
        dict(ring=4, mask=True), dict(ulysses=4, mask=True), dict(ring=2, ulysses=2, mask=True),
    ]))
    broken = got[4, 1, None, False, False]
    assert broken["out"] <= FP32_TOL and broken["dq"] <= FP32_TOL and min(broken["dk"], broken["dv"]) > 1e-1
    assert exact(got[4, 1, None, True, False])
    assert exact(got[2, 2, None, False, False]) and exact(got[1, 4, None, False, False])
    assert got[4, 1, None, False, True]["out"] > 1e-1
    assert exact(got[1, 4, None, False, True])
    assert "must match the size of tensor b" in got[2, 2, None, False, True]["raised"]


def test_choose_names_the_backend_or_why_a_case_cannot_run():
    from paracheck.adapters.diffusers.attention import BACKEND, choose
    from paracheck.adapters.diffusers.layout import DiffusersLayout

    ring, ulysses = DiffusersLayout.parse("r4"), DiffusersLayout.parse("u4")
    # diffusers' own backend wherever one runs the layout; the kit's op only for ring on CPU
    assert choose("auto", "cpu", ring) == (BACKEND, None) and choose("auto", "cpu", ulysses) == ("native", None)
    assert choose("auto", "cpu", DiffusersLayout.parse("tp2xu2")) == ("native", None)
    assert choose("auto", "cuda", ulysses) == ("native", None)
    assert choose("native", "cpu", ulysses) == ("native", None)
    name, why = choose("native", "cpu", ring)
    assert name is None and "returns no log-sum-exp" in why
    name, why = choose("not_a_backend", "cpu", ulysses)
    assert name is None and "not one of diffusers' attention backends" in why
