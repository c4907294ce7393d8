"""Localization's pure parts, in process: reading a split tensor back, comparing traces, gradient patterns,
the merge over ranks and the report lines; and the recorders on a real module."""

import math

import torch
from hypothesis import given, settings, strategies as st

from paracheck.checks import localize
from paracheck.checks.localize import Error, TraceEntry
from paracheck.domain.localization import Localization
from paracheck.domain.records import CheckId, CheckResult, Status
from paracheck.results import localization as merged

shapes = st.lists(st.integers(1, 4), min_size=1, max_size=4).map(tuple)


# -- sharding: how the ranks hold a tensor ---------------------------------------------------------


def _split_shapes(whole: tuple, partition: list, dim: int) -> dict:
    out = {}
    for group in partition:
        for rank in group:
            out[rank] = whole[:dim] + (whole[dim] // len(group),) + whole[dim + 1:]
    return out


@given(shapes, st.integers(0, 3), st.sampled_from([2, 4]))
def test_a_tensor_split_along_one_dim_is_read_back_along_it(base, dim, degree):
    dim = dim % len(base)
    whole = base[:dim] + (base[dim] * degree,) + base[dim + 1:]
    partition = [tuple(range(degree))]
    # Only the split dim differs from the whole shape, so it is the only reading (or the tensor is whole).
    assert localize.sharding(whole, _split_shapes(whole, partition, dim), [("cp", partition, ())]) == (dim,)


@given(shapes, st.integers(0, 3), st.integers(0, 3))
def test_tp_then_cp_splits_are_read_back_with_the_preferred_dims(base, tp_dim, cp_dim):
    rank = len(base)
    tp_dim, cp_dim = tp_dim % rank, cp_dim % rank
    if tp_dim == cp_dim:
        return
    whole = tuple(n * (2 if d in (tp_dim, cp_dim) else 1) for d, n in enumerate(base))
    tp = [(0, 2), (1, 3)]
    cp = [(0, 1), (2, 3)]
    local = tuple(n // 2 if d in (tp_dim, cp_dim) else n for d, n in enumerate(whole))
    found = localize.sharding(whole, dict.fromkeys(range(4), local), [("tp", tp, (tp_dim,)), ("cp", cp, (cp_dim,))])
    assert found == (tp_dim, cp_dim)


def test_a_whole_tensor_is_read_as_held_and_an_odd_shape_says_why():
    groups = [("cp", [(0, 1)], (1,))]
    assert localize.sharding((2, 8), {0: (2, 8), 1: (2, 8)}, groups) == (None,)
    why = localize.sharding((2, 8), {0: (2, 3), 1: (2, 3)}, groups)
    assert isinstance(why, str) and "no split of the reference's (2, 8)" in why
    assert "not recorded on every rank of its cp group" in localize.sharding((2, 8), {0: (2, 4)}, groups)


def test_uneven_shares_sum_to_the_whole():
    assert localize.sharding((1, 7, 3), {0: (1, 4, 3), 1: (1, 3, 3)}, [("cp", [(0, 1)], (1,))]) == (1,)


@given(st.integers(1, 3), st.integers(1, 3), st.integers(2, 4))
def test_a_joint_sequence_is_read_segment_by_segment(text, image, ranks):
    """Each rank holds [its text share, its image share]: one of the readings is the whole [text, image]."""
    whole = torch.arange(float((text + image) * ranks)).reshape(1, -1)
    txt, img = whole[:, :text * ranks], whole[:, text * ranks:]
    pieces = [torch.cat([txt[:, r * text:(r + 1) * text], img[:, r * image:(r + 1) * image]], dim=1)
              for r in range(ranks)]
    readings = dict(localize.segment_readings(pieces, 1, (text, image)))
    assert any(torch.equal(t, whole) for t in readings.values())


# -- comparing traces ----------------------------------------------------------------------------


def _entry(key, start, end, inputs_ok=True, outputs_ok=True, figure=1.0):
    ok, bad = Error(0.0, 0.0, True), Error(figure, figure, False)
    return TraceEntry(key, key, start, end, ok if inputs_ok else bad, ok if outputs_ok else bad)


def test_the_first_beyond_tolerance_the_last_agreeing_and_the_origin():
    """A block whose attention's output projection is the first module to differ (its input, the attention
    op's result, already differs): the difference arises in the attention, whose inputs agree."""
    entries = [_entry("embed", 1, 2), _entry("block.attn.to_q", 4, 5), _entry("block.attn.to_out", 6, 7, False, False),
               _entry("block.attn", 3, 8, True, False), _entry("block", 0, 9, True, False)]
    found = localize.compare_traces(entries)
    assert found.first.module == "block.attn.to_out"
    assert found.last_agreeing.module == "block.attn.to_q"
    assert found.origin == "block.attn"
    assert [m.module for m in found.modules] == [e.key for e in entries]


def test_a_trace_that_agrees_names_nothing():
    found = localize.compare_traces([_entry("a", 0, 1), _entry("b", 2, 3)])
    assert found.first is None and found.origin is None


@given(st.integers(0, 6), st.integers(0, 6))
def test_the_first_is_the_earliest_ending_call_beyond_tolerance(n_good, n_bad):
    entries = [_entry(f"good{i}", 2 * i, 2 * i + 1) for i in range(n_good)]
    entries += [_entry(f"bad{i}", 100 + 2 * i, 101 + 2 * i, outputs_ok=False) for i in range(n_bad)]
    found = localize.compare_traces(entries)
    assert (found.first is None) == (n_bad == 0)
    if n_bad:
        assert found.first.module == "bad0"
        last = found.last_agreeing.module if found.last_agreeing else None
        assert last == (f"good{n_good - 1}" if n_good else None)


def test_a_backward_origin_climbs_by_name_when_time_does_not_nest():
    """The root's backward hooks fire at once when no input needs a gradient, so it encloses nothing in time."""
    entries = [_entry("<root>", 0, 1), _entry("proj_out", 2, 3, inputs_ok=False, outputs_ok=False)]
    assert localize.compare_traces(entries).origin == "<root>"


# -- gradients -----------------------------------------------------------------------------------


@settings(deadline=None)
@given(st.floats(0.05, 20.0).filter(lambda k: abs(k - 1) > 0.05), st.integers(0, 2**16),
       st.integers(1, 5), st.integers(0, 5))
def test_a_subset_off_by_a_factor_is_named_with_it(factor, seed, n_off, n_exact):
    g = torch.Generator().manual_seed(seed)
    refs = {f"layers.{i}.w": torch.randn(3, 4, generator=g) for i in range(n_off + n_exact)}
    off = {f"layers.{i}.w" for i in range(n_off)}
    entries = [localize.grad_entry(n, r * factor if n in off else r.clone(), r, 1e-5, 1e-5) for n, r in refs.items()]
    assert all(math.isclose(e.factor, factor, rel_tol=1e-6) for e in entries if e.param in off)
    text = localize.pattern(entries, {"tp": 2})
    assert f"off by {float(f'{factor:.3g}'):g}" in text
    assert ("every gradient" in text) == (n_exact == 0)
    assert ("everything else exact" in text) == (n_exact > 0)


def test_the_pattern_names_a_layout_degree_and_the_origin_is_the_root_when_every_gradient_moves():
    refs = {"a.weight": torch.randn(4), "b.weight": torch.randn(4), "unused.weight": torch.zeros(4)}
    entries = [localize.grad_entry(n, r * 0.5, r, 1e-5, 1e-5) for n, r in refs.items()]
    found = localize.grads_localization(entries, {"tp": 1, "dp": 2})
    assert found.pattern.startswith("every gradient off by 0.5 = 1/dp")
    assert found.origin == "<root>"
    assert found.params[-1].param == "unused.weight"  # sorted: furthest beyond tolerance first


def test_the_norms_pattern_of_the_issue():
    refs = {f"model.layers.{i}.self_attn.{n}.weight": torch.randn(8) for i in range(2) for n in ("q_norm", "k_norm")}
    refs.update({f"model.layers.{i}.mlp.up.weight": torch.randn(8, 8) for i in range(2)})
    entries = [localize.grad_entry(n, r * (4.0 if "norm" in n else 1.0), r, 1e-5, 1e-5) for n, r in refs.items()]
    found = localize.grads_localization(entries, {"tp": 4})
    names, _, rest = found.pattern.partition(" off by ")
    assert set(names.split(", ")) == {"model.layers.*.self_attn.q_norm.weight", "model.layers.*.self_attn.k_norm.weight"}
    assert rest == "4 = tp; everything else exact"
    assert found.origin.endswith("_norm.weight")


def test_no_common_factor_and_missing_gradients_are_said_so():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(5, generator=g)
    entries = [localize.grad_entry("noisy", ref + torch.randn(5, generator=g), ref, 1e-5, 1e-5),
               localize.grad_entry("gone", None, ref, 1e-5, 1e-5), localize.grad_entry("fine", ref, ref, 1e-5, 1e-5)]
    text = localize.pattern(entries, {})
    assert "noisy off with no common factor" in text and "gone: no gradient" in text and "everything else exact" in text
    found = localize.grads_localization(entries, {})
    assert found.params[0].param == "gone" and found.to_json()["params"][0]["over"] is None  # JSON-safe: no infinity


def test_an_entry_measures_how_far_past_the_bound():
    ref = torch.tensor([1.0, 100.0], dtype=torch.float64)
    entry = localize.grad_entry("w", ref + 3e-5, ref, 1e-5, 1e-5)
    assert not entry.within and math.isclose(entry.over, 3e-5 / 2e-5, rel_tol=1e-3)


# -- recorders on a real module ------------------------------------------------------------------


class _Two(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_the_recorder_keeps_calls_in_execution_order_and_nests_them():
    model = _Two()
    with localize.Recorder(model) as rec:
        model(torch.randn(2, 3))
    assert [c.key for c in rec.calls] == ["a", "b", "<root>"]
    root = rec.calls[-1]
    assert all(root.start < c.start and c.end < root.end for c in rec.calls[:-1])
    assert rec.calls[0].input_names == ["0"] and rec.calls[0].outputs[0].shape == (2, 3)
    assert not model._forward_hooks and not model.a._forward_pre_hooks  # the hooks are gone


def test_a_planted_difference_is_found_where_it_was_planted_in_process():
    torch.manual_seed(0)
    ref, par = _Two(), _Two()
    par.load_state_dict(ref.state_dict())
    with torch.no_grad():
        par.b.weight[0, 0] += 1.0
    x = torch.randn(2, 3)
    traces = []
    for model in (ref, par):
        with localize.Recorder(model) as rec:
            model(x)
        traces.append(rec.calls)
    gathered = {c.key: [("in", i, t, []) for i, t in enumerate(c.inputs)] +
                [("out", i, t, []) for i, t in enumerate(c.outputs)] for c in traces[1]}
    found = localize.compare_traces(localize.compare_calls(gathered, traces[0], 1e-5, 1e-5))
    assert found.origin == "b" and found.last_agreeing.module == "a"


def test_the_backward_recorder_sees_received_and_passed_gradients():
    model = _Two()
    with localize.BackwardRecorder(model) as rec:
        model(torch.randn(2, 3, requires_grad=True)).sum().backward()
    assert [c.key for c in rec.calls][:2] == ["b", "a"] or [c.key for c in rec.calls][0] == "b"
    assert all(c.inputs for c in rec.calls)


# -- over ranks, and the report -------------------------------------------------------------------


def _check(check_id, status, found):
    return CheckResult(check_id, status, data={"localization": found})


def test_the_merge_shows_the_first_failing_rank_and_names_the_ranks_that_agree():
    same = {"forward": {"first": {"module": "x"}, "origin": "x", "modules": []}}
    other = {"forward": {"first": {"module": "y"}, "origin": "y", "modules": []}}
    per_check = {CheckId.FORWARD: [(0, _check(CheckId.FORWARD, Status.PASS, other)),
                                   (1, _check(CheckId.FORWARD, Status.FAIL, same)),
                                   (2, _check(CheckId.FORWARD, Status.FAIL, same))]}
    found = merged.merge(per_check).forward.merged
    assert found.rank == 1 and found.ranks == (1, 2) and found.other_ranks == {"0": {"first": "y", "origin": "y"}}


def test_a_no_grad_failure_alone_is_the_forward():
    found = {"forward": {"first": None, "origin": None, "modules": [], "pass": "no_grad"}}
    per_check = {CheckId.INFERENCE: [(0, _check(CheckId.INFERENCE, Status.FAIL, found))]}
    assert merged.merge(per_check).forward.pass_name == "no_grad"


def test_the_note_names_the_first_module_the_last_agreeing_and_the_top_gradients():
    params = [{"param": f"p{i}", "max_abs": 1.0, "max_rel": 0.5, "within": False, "over": 10.0 - i} for i in range(12)]
    loc = {"forward": {"pass": "training", "ranks": [0, 1], "first": {"module": "attn.to_out", "max_abs": 0.4,
                                                                        "max_rel": 0.9},
                       "origin": "attn", "last_agreeing": {"module": "attn.to_q"}, "not_compared": []},
           "grads": {"ranks": [0, 1], "pattern": "every gradient off by 1.5", "params": params}}
    lines = merged.note(Localization.from_json(loc))
    assert "first module beyond tolerance: attn.to_out" in lines[0] and "arising in attn" in lines[0]
    assert "last agreeing: attn.to_q" in lines[0] and "ranks 0,1" in lines[0]
    assert lines[1].endswith("every gradient off by 1.5")
    assert len(lines) == 2 + merged.TOP and "p0" in lines[2]


def test_a_pipeline_note_says_which_stage_compared_each_and_which_were_handed_a_difference():
    loc = {"forward": {"pass": "training", "ranks": [0, 1, 2, 3],
                       "first": {"module": "model.layers.1", "max_abs": 0.08, "max_rel": 0.7, "stage": 0},
                       "origin": "model.layers.1", "last_agreeing": {"module": "model.layers.1.mlp", "stage": 0},
                       "boundaries": [{"stage": 1, "inputs_within": False}, {"stage": 2, "inputs_within": False}],
                       "not_compared": []}}
    line = merged.note(Localization.from_json(loc))[0]
    assert "first module beyond tolerance: model.layers.1 (stage 0) (max_abs" in line and "arising" not in line
    assert "last agreeing: model.layers.1.mlp (stage 0); stages 1, 2 handed a difference" in line


def test_the_stripped_data_keeps_the_other_figures():
    assert merged.strip({"localization": {}, "ratio": 1.0}) == {"ratio": 1.0}


def test_a_packed_projection_is_read_in_its_blocks_order():
    """Five blocks (q, k, v and two MLP halves), each sharded on its own over two ranks."""
    blocks = [torch.arange(float(n)) + 100 * i for i, n in enumerate((4, 4, 4, 8, 8))]
    whole = torch.cat(blocks)
    pieces = [torch.cat([b.chunk(2)[r] for b in blocks]) for r in range(2)]
    readings = dict(localize.segment_readings(pieces, 0, ((2, 2, 2, 4, 4),)))
    assert any(torch.equal(t, whole) for t in readings.values())
