"""The localization records (`domain.localization`): each written to JSON and read back is the same record, through
a JSON document too; a report's localization, read and written, is the same JSON; what is not the schema reads as
absent."""

from __future__ import annotations

import json

from hypothesis import given, settings, strategies as st

from paracheck.domain.localization import (Boundary, ForwardLocalization, GradRow, GradsLocalization, Localization,
                                           Merged, ModuleRow, Planted, Skipped, StepsLocalization)
from tests.html_sample import localization

names = st.text(min_size=1, max_size=6)
words = st.text(max_size=6)
maybe_words = st.none() | words
figures = st.none() | st.floats(allow_nan=False)
small = st.integers(min_value=0, max_value=8)
maybe_small = st.none() | small
flags = st.none() | st.booleans()

merged = st.just(Merged()) | st.builds(Merged, small, st.lists(small, max_size=3).map(tuple),
                                       st.dictionaries(st.text(max_size=2), words, max_size=2))
modules = st.builds(ModuleRow, names, figures, figures, flags, words, words, maybe_small)
skipped = st.builds(Skipped, names, words, maybe_small)
boundaries = st.builds(Boundary, maybe_small, names, flags, figures)


def _tuples(strategy):
    return st.none() | st.lists(strategy, max_size=3).map(tuple)


@st.composite
def forwards(draw, depth: int = 0):
    rows = draw(_tuples(modules))
    traced = rows is not None
    return ForwardLocalization(
        rows, draw(st.none() | modules) if traced else None, draw(st.none() | modules) if traced else None,
        draw(st.none() | names) if traced else None, draw(_tuples(skipped)), draw(_tuples(boundaries)),
        draw(maybe_small), draw(figures), draw(figures), draw(maybe_words), draw(flags), draw(maybe_words),
        draw(maybe_small), draw(maybe_small), draw(maybe_small), draw(maybe_words), draw(merged))


grad_rows = st.builds(GradRow, names, figures, figures, flags, figures, words, figures, st.booleans())


@st.composite
def grads(draw):
    params = draw(_tuples(grad_rows))
    return GradsLocalization(params, draw(maybe_words) if params is not None else None, draw(st.none() | names),
                             draw(st.none() | forwards()), draw(maybe_words), draw(maybe_words), draw(merged))


@st.composite
def steps(draw):
    where = draw(st.none() | st.sampled_from(["forward", "gradients", "update"]))
    return StepsLocalization(draw(maybe_small), draw(maybe_small), draw(st.none() | forwards()),
                             draw(st.none() | grads()), where, draw(st.none() | names) if where else None,
                             draw(maybe_words), draw(merged))


planted = st.builds(Planted, words, st.none() | names, words, st.booleans(), st.none() | names)
localizations = st.builds(Localization, st.none() | forwards(), st.none() | forwards(), st.none() | grads(),
                          st.none() | forwards(), st.none() | steps(), maybe_words, st.none() | planted)


@settings(max_examples=25, deadline=None)
@given(localizations)
def test_a_localization_written_and_read_back_is_the_same(found):
    assert Localization.from_json(found.to_json()) == found
    assert Localization.from_json(json.loads(json.dumps(found.to_json()))) == found


@settings(max_examples=25, deadline=None)
@given(st.one_of(forwards(), grads(), steps()))
def test_each_part_written_and_read_back_is_the_same(part):
    assert type(part).from_json(json.loads(json.dumps(part.to_json()))) == part


def test_a_reports_localization_read_and_written_is_the_same_json():
    """A merged case's localization in the report's spelling (docs/reports.md), NaN included, comes back as it was."""
    loc = localization()
    assert json.dumps(Localization.from_json(loc).to_json(), sort_keys=True) == json.dumps(loc, sort_keys=True)


def test_what_is_not_the_schema_reads_as_absent():
    assert not Localization.from_json(None) and not Localization.from_json({"grads": [1]})
    found = GradsLocalization.from_json({"params": [{"param": "w", "max_abs": "big", "within": 1}, 3]})
    assert found.params == (GradRow("w"),) and found.pattern is None
    assert ForwardLocalization.from_json({"origin": {"module": "a.b"}}).origin == "a.b"
