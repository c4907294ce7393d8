"""The run's record: written and read by the same code, never raising on a report it did not write."""

from hypothesis import given, strategies as st

from paracheck.results.runmeta import RunMeta

_text = st.one_of(st.none(), st.text(min_size=1, max_size=8))
_count = st.one_of(st.none(), st.integers(0, 64))
metas = st.builds(RunMeta, paracheck=_text, backend=_text, nproc=_count,
                  versions=st.dictionaries(st.text(min_size=1, max_size=6), _text, max_size=3),
                  worlds=_count, start_method=_text, references=_count,
                  start_seconds=st.one_of(st.none(), st.floats(0, 1e4)),
                  extra=st.dictionaries(st.sampled_from(["families", "local_world", "shard"]), st.integers(), max_size=2))


@given(metas)
def test_a_record_reads_back_as_written(meta):
    assert RunMeta.from_json(meta.to_json()) == RunMeta(**{**meta.__dict__, "extra": {}})


@given(st.dictionaries(st.sampled_from(["paracheck", "backend", "nproc", "versions", "worlds", "start_method",
                                        "references", "start_seconds"]),
                       st.one_of(st.none(), st.booleans(), st.integers(), st.text(), st.lists(st.integers()))))
def test_a_report_off_the_schema_reads_as_absent_fields(data):
    meta = RunMeta.from_json(data)
    assert meta.nproc is None or isinstance(meta.nproc, int) and not isinstance(meta.nproc, bool)
    assert isinstance(meta.versions, dict)


def test_the_run_fields_come_first_and_unknown_ones_are_left_out():
    meta = RunMeta(paracheck="1", backend="gloo", nproc=4, versions={"torch": "2.13"}, worlds=2).with_extra(shard="1/3")
    assert list(meta.to_json()) == ["paracheck", "backend", "nproc", "versions", "worlds", "shard"]


def test_an_extra_named_as_a_field_is_refused():
    import pytest

    with pytest.raises(ValueError, match="nproc"):
        RunMeta(nproc=2).with_extra(nproc=4)
