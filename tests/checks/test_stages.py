"""Localization across pipeline stages, in process: which modules a stage holds whole, and one pipeline's stages'
traces joined into one (the real stages are in tests/adapters/transformers/test_localize_controls.py)."""

import torch
from hypothesis import given, strategies as st

from paracheck.checks import stages
from paracheck.checks.localize import Error, TraceEntry


class Placeholder(torch.nn.Identity):
    """Stands in for a layer another stage holds."""


def test_a_stage_holds_its_layers_and_not_what_is_around_another_stages():
    layers = torch.nn.ModuleList([torch.nn.Linear(2, 2), Placeholder()])
    model = torch.nn.Module()
    model.embed, model.layers = torch.nn.Linear(2, 2), layers
    held = stages.held(model, lambda m: isinstance(m, Placeholder))
    assert held == {"embed", "layers.0"}  # not the list around the placeholder, nor the root


def _entry(key, start, end, inputs_ok=True, outputs_ok=True):
    ok, bad = Error(0.0, 0.0, True), Error(1.0, 1.0, False)
    return TraceEntry(key, key, start, end, ok if inputs_ok else bad, ok if outputs_ok else bad)


def _pipeline(n_stages: int, bad_layer: int | None):
    """(parts, reference keys): one layer per stage, a rotary every stage runs, the output on the last; the layer
    `bad_layer` differs (its inputs agree), and every later one, handed its output, differs from its inputs on."""
    parts = []
    for s in range(n_stages):
        late = bad_layer is not None and s > bad_layer
        entries = [_entry("rotary", 1, 2),
                   _entry(f"layers.{s}", 10 + 2 * s, 11 + 2 * s, not late, bad_layer is None or s < bad_layer)]
        if s == n_stages - 1:
            entries.append(_entry("<root>", 0, 100, True, bad_layer is None))
        parts.append((s, entries, [], {"rotary", f"layers.{s}"}))
    return parts, ["<root>", "rotary", "model"] + [f"layers.{s}" for s in range(n_stages)]


@given(st.integers(2, 5), st.data())
def test_every_stage_names_the_same_origin_over_the_whole_pipeline(n_stages, data):
    bad = data.draw(st.integers(0, n_stages - 1) | st.none())
    parts, keys = _pipeline(n_stages, bad)
    ref = [TraceEntry(k, k, 0, 0, None, None) for k in keys]
    shuffled = data.draw(st.permutations(parts))  # the order the stages' parts arrive in does not matter
    found = stages.join(list(shuffled), ref)
    assert found.origin == (None if bad is None else f"layers.{bad}")
    if bad is not None:
        assert found.first.stage == bad and found.first.module == f"layers.{bad}"
    by_module = {(m.module, m.stage) for m in found.modules}
    assert {(f"layers.{s}", s) for s in range(n_stages)} <= by_module and ("<root>", n_stages - 1) in by_module
    # The decoder around every stage's layers is listed, not dropped; each later stage says what it was handed.
    assert [n.module for n in found.not_compared] == ["model"]
    assert [b.stage for b in found.boundaries] == list(range(1, n_stages))
    assert all(b.inputs_within == (bad is None or b.stage <= bad) for b in found.boundaries)
