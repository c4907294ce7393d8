"""`paracheck explore`: the pieces in process (shapes, strategy, signatures, found files), then real gloo
worlds: a planted bug that needs two samples and a mask is found and shrunk to exactly that, and its spec
file replays it; a correct model gives nothing. The transformers side (token rows: padding side, packing)
is in tests/adapters/transformers/test_explore_transformers.py."""

from __future__ import annotations

import json
import os
import shlex

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paracheck.adapters.diffusers.explore import draw_options
from paracheck.adapters.diffusers.options import parse_cp_options
from paracheck.domain.case import Case, load_factory
from paracheck.explore.engine import Target, draws, signature
from paracheck.adapters.diffusers.fixtures_index import FIXTURE_SPACES, FIXTURE_VARIANTS
from paracheck.explore.found import Found, read, write
from paracheck.adapters.diffusers.layout import DiffusersLayout
from paracheck.domain.records import CaseStatus, CheckId, Failure, FailureKind, MergedCheck, Route, Status
from paracheck.domain.shapes import Axis, Shape
from paracheck.results.verdict import Verdict

from tests.support import SPECS, run_paracheck

U2 = DiffusersLayout.parse("u2", "cp-fastest")
TARGETS = [Target(name, f"paracheck.fixtures:{name}", space, (U2, DiffusersLayout.parse("r2", "cp-fastest")), "diffusers", draw_options)
           for name, space in FIXTURE_SPACES.items()]


def _shapes():
    return st.builds(lambda batch, lengths, padded, shared: Shape(batch, lengths, padded=padded[:batch] if padded else (),
                                                                 shared_timestep=shared),
                     st.integers(1, 3), st.dictionaries(st.sampled_from(["image", "text", "rows"]),
                                                        st.integers(1, 30)).map(lambda d: tuple(d.items())),
                     st.one_of(st.just(()), st.lists(st.integers(0, 9), min_size=3, max_size=3).map(tuple)),
                     st.booleans())


def _token_shapes():
    """Token rows padded on either side, or packed (documents per row), or neither."""
    def build(batch, length, padded, side, documents, kind):
        if kind == "padded":
            return Shape(batch, (("tokens", length),), padded=padded[:batch], pad_side=side, token_rows=True)
        if kind == "packed":
            return Shape(batch, (("tokens", length),), documents=documents[:batch], token_rows=True)
        return Shape(batch, (("tokens", length),), token_rows=True)

    return st.builds(build, st.integers(1, 3), st.integers(2, 64), st.lists(st.integers(0, 9), min_size=3, max_size=3),
                     st.sampled_from(["left", "right"]),
                     st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=4).map(tuple), min_size=3, max_size=3),
                     st.sampled_from(["plain", "padded", "packed"]))


@given(st.one_of(_shapes(), _token_shapes()))
def test_shape_round_trips_through_json(shape):
    assert Shape.from_json(json.loads(json.dumps(shape.to_json()))) == shape


def test_named_variants_are_shapes_with_their_labels():
    for name in ("base", "batch2", "masked", "uneven"):
        assert Shape.of_variant(name).label == name
    assert Shape.of_variant("masked").masked_count(1, 8) == 3 and Shape.of_variant("masked").masked_count(0, 8) == 0
    assert Shape(batch=1, padded=(99,)).masked_count(0, 5) == 4  # one position always stays


def test_token_rows_are_named_as_runs_transformers_variants():
    rows = dict(batch=2, lengths=(("tokens", 12),), token_rows=True)
    assert Shape(**rows).label == "base" and Shape(**dict(rows, batch=3)).label == "base"  # no batch2 for token rows
    assert Shape(**rows, padded=(0, 4), pad_side="left").label == "left_pad"
    assert Shape(**rows, padded=(0, 4)).label == "right_pad"
    assert Shape(**rows, documents=((5, 7), (12,))).label == "packed"
    # Nothing padded: the side changes no input, so the two sides are one shape (and one cached case).
    assert Shape(**rows, padded=(0, 0), pad_side="left") == Shape(**rows, padded=(0, 0))
    # A diffusers shape's JSON is what it was before token rows existed (case keys and found stems stay).
    assert set(Shape(2, padded=(0, 1)).to_json()) == {"batch", "lengths", "uneven", "padded", "shared_timestep"}


@pytest.mark.parametrize("fields,words", [
    (dict(pad_side="top"), "pad_side='top'.*must be one of right, left"),
    (dict(padded=(0, 1), pad_side="left"), "only token rows are padded at the start"),
    (dict(documents=((1, 1), (2,))), "only token rows are packed"),
    (dict(documents=((2,),), token_rows=True), "one row of document lengths >= 1 per sample"),
    (dict(documents=((0, 2), (2,)), token_rows=True), "one row of document lengths >= 1 per sample"),
    (dict(documents=((1, 1), (2,)), padded=(0, 1), token_rows=True), "a packed row carries no padding"),
])
def test_bad_token_fields_name_the_field_and_the_rule(fields, words):
    with pytest.raises(ValueError, match=words):
        Shape(batch=2, **fields)


def test_a_token_space_has_one_axis_named_tokens():
    from paracheck.domain.shapes import Space

    with pytest.raises(ValueError, match="token rows have one axis, 'tokens'"):
        Space(dict(text=Axis(4, 4)), token_rows=True)


def test_axis_rejects_a_range_that_excludes_its_defaults():
    with pytest.raises(ValueError, match="low <= even"):
        Axis(4, 3, low=5)


@settings(max_examples=60)
@given(st.data())
def test_draws_stay_inside_each_models_space(data):
    d = data.draw(draws(TARGETS, ["fp32", "bf16"]))
    space = d.target.space
    assert d.layout in d.target.layouts and 1 <= d.shape.batch <= space.batch
    assert {k: v for k, v in d.shape.lengths} .keys() == space.axes.keys()
    assert all(v in space.axes[k].values for k, v in d.shape.lengths)
    assert not d.shape.padded or (space.masks and len(d.shape.padded) == d.shape.batch)
    assert all(dict(d.options).get(k) is None for k in ("ulysses_anything", "ring_anything")) or not d.uneven
    if d.layout.ring == 1:
        assert "rotate_method" not in dict(d.options)


def _verdict(status, checks=(), reason="", layout="u2", failure=None):
    case = Case("ltx", "paracheck.fixtures:ltx", DiffusersLayout.parse(layout, "cp-fastest"), library="diffusers")
    return Verdict(case, status, Route.NATIVE, reason=reason, checks=list(checks), model_class="LTXVideoTransformer3DModel",
                   failure=failure)


def _grads_raised(message):
    failure = Failure(FailureKind.RAISE, CheckId.GRADS, "RuntimeError", "_tensor.view")
    raised = MergedCheck(CheckId.GRADS, Status.FAIL, [0, 1], detail=f"rank 0: backward raised RuntimeError: {message}",
                         failure=failure)
    return _verdict(CaseStatus.ERROR, [MergedCheck(CheckId.FORWARD, Status.PASS), raised], failure=failure)


def test_signature_names_the_first_failing_check_and_where_it_raised():
    assert signature(_grads_raised("shape '[1, 4]' is invalid")) == (
        "LTXVideoTransformer3DModel parity.grads: RuntimeError in _tensor.view")
    wrong = Failure(FailureKind.CHECK, CheckId.FORWARD)
    assert signature(_verdict(CaseStatus.FAIL, layout="r2xu2", failure=wrong)).endswith(
        "parity.forward: wrong under ring+ulysses")
    assert signature(_verdict(CaseStatus.PASS)) is None and signature(_verdict(CaseStatus.XFAIL)) is None
    hang = _verdict(CaseStatus.ERROR, reason="rank 1: hung past --timeout 120s in x.py:3; ranks 0 were waiting on them",
                    failure=Failure(FailureKind.HANG, site="x.wait"))
    assert signature(hang) == "LTXVideoTransformer3DModel error: hung in x.wait"


def test_rewording_a_message_keeps_the_signature():
    """explore de-duplicates by signature: it must come from the typed failure, never from the prose."""
    first = _grads_raised("shape '[1, 4, 2, 1, 12]' is invalid for input of size 48")
    reworded = _grads_raised("cannot view a tensor of 48 elements as [1, 4, 2, 1, 12]")
    reworded.reason = "something else entirely"
    assert signature(first) == signature(reworded)
    other = _grads_raised("shape '[1, 4]' is invalid")
    other.failure = other.checks[1].failure = Failure(FailureKind.RAISE, CheckId.GRADS, "ValueError", "_tensor.view")
    assert signature(other) != signature(first)


def test_cp_options_parse_and_name_the_rule():
    assert parse_cp_options("rotate_method=alltoall,ulysses_anything=true") == (
        ("rotate_method", "alltoall"), ("ulysses_anything", True))
    for bad, rule in (("ring=1", "name one of"), ("convert_to_fp32=maybe", "takes True or False"), ("x", "name=value")):
        with pytest.raises(ValueError, match=rule):
            parse_cp_options(bad)


def test_found_case_round_trips_and_its_spec_builds_the_same_inputs(tmp_path):
    shape = Shape(2, (("height", 2), ("width", 1), ("text", 2)), padded=(0, 1))
    case = Case("qwenimage", "paracheck.fixtures:qwenimage", U2, variant="masked", shape=shape, library="diffusers",
                cp_options=(("ulysses_anything", True),))
    spec, command = write(str(tmp_path), Found(case, "sig", "detail"), 2, None, True, {"diffusers": "x"})
    assert read(str(tmp_path)) == [Found(case, "sig", "detail")]
    assert "--cp-options ulysses_anything=True --known-failures none" in command
    factory = load_factory(f"{spec}:qwenimage")
    assert factory.variants == ("masked",)
    _, _, inputs = factory("masked")
    assert inputs["hidden_states"].shape[:2] == (2, 2) and inputs["encoder_hidden_states_mask"].tolist() == [[1, 1], [1, 0]]


def test_fixture_spaces_cover_every_fixture_and_their_masks():
    assert set(FIXTURE_SPACES) == set(FIXTURE_VARIANTS)
    for name, space in FIXTURE_SPACES.items():
        assert space.masks == ("masked" in FIXTURE_VARIANTS[name]), name


@pytest.mark.slow
def test_explore_finds_a_planted_bug_and_shrinks_it_to_two_samples_and_a_mask(tmp_path):
    out = tmp_path / "found"
    run = run_paracheck(["--spec", f"{SPECS}:batch_mask_bug", "--nproc", "2", "--layouts", "u2", "--examples", "25",
                         "--seed", "0", "--out", str(out), "--quiet"], tmp_path, command="explore")
    assert run.code == 1, run.out
    [found] = run.report["found"]
    assert found["signature"] == "BatchMaskBugQwenImage parity.forward: wrong under ulysses"
    assert found["shape"] == "batch 2, height 2, text 2, width 1, padded [0, 1]", run.out
    assert found["cp_options"] == {} and found["dtype"] == "fp32"
    assert os.listdir(run.tmpdir) == []  # the fed world's directory is gone
    # The spec file replays the failure with the command it carries.
    replay = run_paracheck(shlex.split(found["replay"])[2:], tmp_path)
    assert replay.code == 1, replay.out
    [case] = replay.report["cases"]
    assert case["variant"] == "masked" and case["status"] == "fail"
    # A second explore tries the found case first and finds it again before drawing anything.
    again = run_paracheck(["--spec", f"{SPECS}:batch_mask_bug", "--nproc", "2", "--layouts", "u2", "--examples", "1",
                           "--seed", "5", "--out", str(out), "--quiet"], tmp_path, command="explore")
    assert again.code == 1 and "1 found before" in again.out, again.out


@pytest.mark.slow
def test_explore_is_quiet_on_a_correct_model(tmp_path):
    run = run_paracheck(["--models", "flux", "--nproc", "2", "--layouts", "u2,tp2", "--examples", "8", "--seed", "3",
                         "--out", str(tmp_path / "found")], tmp_path, command="explore")
    assert run.code == 0, run.out
    assert run.report["found"] == [] and run.report["cases_run"] >= 4
    assert not (tmp_path / "found").exists()
