"""Records survive the file boundary unchanged; payloads survive the trip to the ranks."""

import torch
from hypothesis import given, strategies as st

from paracheck.domain.case import Case
from paracheck.domain.records import CheckId, CheckResult, Failure, FailureKind, RankResult, RankStatus, Route, Status
from tests import strategies

failures = st.none() | st.builds(Failure, st.sampled_from(list(FailureKind)), st.none() | st.sampled_from(list(CheckId)),
                                 st.text(max_size=8), st.text(max_size=8), st.text(max_size=8), st.text(max_size=8))
checks = st.builds(CheckResult, st.sampled_from(list(CheckId)), st.sampled_from(list(Status)), st.text(max_size=20),
                   st.none() | st.floats(0, 1), st.none() | st.floats(0, 1), failure=failures)
results = st.builds(RankResult, st.integers(0, 100), st.integers(0, 127), st.sampled_from(list(RankStatus)),
                    st.text(max_size=30), st.none() | st.sampled_from(list(Route)), st.lists(checks, max_size=4),
                    st.lists(st.text(max_size=10), max_size=2), secondary=st.booleans(), failure=failures)


@given(results)
def test_rank_result_round_trips_through_json(result):
    import json

    assert RankResult.from_json(json.loads(json.dumps(result.to_json()))) == result


def _raise(message):
    def helper():
        raise ValueError(message)

    try:
        helper()
    except ValueError as exc:
        return Failure.raised(exc, CheckId.FORWARD)


def test_a_raise_is_identified_by_type_and_site_never_by_its_message():
    first, reworded = _raise("shape [1, 4] is invalid"), _raise("a wholly different sentence, 99 of them")
    assert first == reworded and first.key == reworded.key
    assert (first.kind, first.check, first.exception, first.site) == (
        FailureKind.RAISE, CheckId.FORWARD, "ValueError", "test_records.helper")


def test_a_library_entry_point_is_named_and_its_cause_identified():
    class Wrapped(Exception):  # what `library.entry_point` raises: the entry point and the cause as fields
        entry_point = "enable_parallelism"

        def __init__(self, cause):
            super().__init__(f"reworded freely: {cause}")
            self.cause = cause

    try:
        try:
            raise KeyError("blocks.2")
        except KeyError as exc:
            raise Wrapped(exc) from exc
    except Wrapped as exc:
        failure = Failure.raised(exc)
    assert (failure.exception, failure.entry_point) == ("KeyError", "enable_parallelism")
    assert failure.site.endswith("test_a_library_entry_point_is_named_and_its_cause_identified")


@given(strategies.layouts(4), st.sampled_from(list(Route)), st.none() | st.sampled_from(["backward-only"]),
       st.sampled_from(["base", "batch2"]), st.sampled_from(["fp32", "bf16"]))
def test_case_round_trips_and_names_itself(layout, route, control, variant, dtype):
    case = Case("flux", "paracheck.fixtures:flux", layout, route, control, variant=variant, dtype=dtype, library="diffusers")
    from paracheck.domain.registry import parse_layout

    assert Case.from_json(case.to_json(), parse_layout) == case
    assert case.id.startswith(f"flux-{layout.name}-{route.value}")
    assert (variant in case.id) == (variant != "base") and case.plain.control is None


def test_payload_round_trip(tmp_path):
    from diffusers import QwenImageTransformer2DModel

    from paracheck.adapters.diffusers.payload import dump, load

    inputs = {"x": torch.arange(6.0).reshape(2, 3), "img_shapes": [(1, 4, 4)], "nested": {"n": 3, "t": (1, "a")}}
    dump(str(tmp_path), QwenImageTransformer2DModel, {"axes_dims_rope": (8, 4, 4), "num_layers": 2}, inputs)
    cls, init, back = load(str(tmp_path))
    assert cls is QwenImageTransformer2DModel and init == {"axes_dims_rope": (8, 4, 4), "num_layers": 2}
    assert torch.equal(back["x"], inputs["x"]) and back["img_shapes"] == [(1, 4, 4)] and back["nested"] == inputs["nested"]


def test_rank_progress_and_todo_round_trip_and_a_torn_progress_file_reads_as_none():
    from paracheck.launch.protocol import Phase, RankProgress, Todo

    started = RankProgress(Phase.STARTED, 12.5, 7)
    assert RankProgress.from_json(started.to_json()) == started and started.running
    assert not RankProgress(Phase.WAITING, 1.0).running
    assert RankProgress.from_json(None) is None
    assert RankProgress.from_json({"index": 3, "started": 1.0}) is None  # another version's file
    assert Todo.from_json(Todo((3, 1, 2)).to_json()) == Todo((3, 1, 2))
    assert Todo.from_json(Todo(feed_from=5).to_json()).feed_from == 5


def test_a_run_event_round_trips_and_one_that_is_not_the_schemas_reads_as_absent():
    from paracheck.domain.records import RunEvent

    event = RunEvent("hang", 3, "rank 1 stuck", "flux-u4-auto")
    assert RunEvent.from_json(event.to_json()) == event and RunEvent.from_json({"kind": "start"}).case == ""
    assert RunEvent.from_json({"kind": ["x"], "index": "2"}) == RunEvent("", None, "") and RunEvent.from_json(3) is None


def test_a_hang_is_declared_by_its_cases_xfail_on_the_hang_itself_and_nothing_else():
    """`RunEvent.declared_by`, the one rule the exit code, the console and the HTML report ask."""
    from paracheck.domain.records import RunEvent

    hang, signal = RunEvent("hang", 0, "stuck", "m-u4-auto"), RunEvent("signal", 0, "SIGKILL", "m-u4-auto")
    assert hang.declared_by("xfail", "hang")
    assert not hang.declared_by("error", "hang") and not hang.declared_by("xfail", "check")
    assert not hang.declared_by("xfail", None) and not signal.declared_by("xfail", "hang")
