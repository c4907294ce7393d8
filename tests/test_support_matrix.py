"""scripts/support_matrix.py's pure parts: a pass the sweep runs on some layouts gets its own column, which names
each layout where it did not pass and whether that was declared, and one sweep's reports split into the causal-LM
matrix and the other tasks' (docs/support-matrix.md, docs/support-matrix-tasks.md)."""

from paracheck.domain.records import BEYOND_PRECISION
from tests.support import script


def _case(model, layout, status="pass", control="", **checks):
    return {"id": f"{model}-{layout}-{control}", "model": model, "layout": layout, "status": status,
            "control": control, "reason": "", "checks": [{"id": k.replace("_", "."), "status": v}
                                                         for k, v in checks.items()]}


def test_a_pass_column_names_the_layouts_that_did_not_pass_and_whether_declared():
    matrix = script("support_matrix")
    cases = {c["id"]: c for c in [
        _case("llama", "tp4", parity_steps="pass"), _case("llama", "fsdp4", "xfail", parity_steps="fail"),
        _case("llama", "dpr4", "fail", parity_steps="fail"), _case("llama", "tp2xdpr2"),
        _case("llama", "tp4", "detected", "tf-grad-divide", parity_steps="fail")]}
    assert matrix.later(cases, "parity.steps") == {"llama": "FAIL dpr4, xfail fsdp4 (of 3)"}
    assert matrix.later({k: v for k, v in cases.items() if v["status"] == "pass"}, "parity.steps") == \
        {"llama": "pass (1)"}
    beyond = _case("gemma4_text", "dpr4", parity_steps="pass")
    beyond["checks"][0]["data"] = {"per_rank": {"0": {"beyond_step": 3, BEYOND_PRECISION: True}, "1": {}}}
    excused = _case("gemma4_text", "fsdp4", parity_steps="pass")
    excused["checks"][0]["data"] = {"per_rank": {"0": {"steps": [{"excused": {"w": {}}}]}}}
    assert matrix.later({c["id"]: c for c in (beyond, excused)}, "parity.steps") == \
        {"gemma4_text": "beyond dpr4 (of 2)"}


def test_one_sweep_splits_into_the_causal_lm_matrix_and_the_other_tasks():
    matrix = script("support_matrix")
    cases = {c["id"]: c for c in [_case("llama", "tp4", parity_generate="pass", checkpoint_roundtrip="pass"),
                                  _case("llama-seq-cls", "tp4", checkpoint_roundtrip="fail", status="xfail"),
                                  _case("llava-image-text", "fsdp4")]}
    causal, other = matrix.by_task(cases, True), matrix.by_task(cases, False)
    assert [c["model"] for c in causal.values()] == ["llama"]
    assert sorted(c["model"] for c in other.values()) == ["llama-seq-cls", "llava-image-text"]
    text = matrix.render(other, {}, None)
    row = next(line for line in text.splitlines() if line.startswith("| llama-seq-cls"))
    assert row.endswith("| does not generate |  | xfail tp4 (of 1) |")
    assert "| tp4 | fsdp4 | generate | steps | checkpoint |" in text
    quoted = matrix.render(other, {}, None, "The shards at commit abc, two families rerun at def.").splitlines()
    assert quoted[6] == "The shards at commit abc, two families rerun at def." and quoted[8].startswith("**")


def test_the_shard_driver_skips_finished_shards_and_takes_a_stopped_one_as_unfinished(tmp_path):
    """scripts/sweep_shards.py: a shard marked done is not run again; a report naming cases it did not finish (an
    interrupted run's `not_run`, or its `interrupted` event), or none at all, is no finished shard; the earlier
    report a stopped shard resumes from is kept where the matrices' `shard*.json` does not pick it up."""
    import json

    import fnmatch
    import os

    driver = script("sweep_shards")
    assert not fnmatch.fnmatch(os.path.basename(driver._earlier(str(tmp_path), 5)), "shard*.json")
    for i in (1, 2):
        (tmp_path / f"shard{i}.done").touch()
    assert driver.main([str(tmp_path), "--shards", "2"]) == 0 and not (tmp_path / "walls.json").exists()
    report = tmp_path / "r.json"
    assert driver._interrupted(str(report))
    for data, stopped in (({"cases": []}, False), ({"not_run": ["a"]}, True),
                          ({"events": [{"kind": "interrupted", "index": None, "message": "SIGTERM"}]}, True)):
        report.write_text(json.dumps(data))
        assert driver._interrupted(str(report)) == stopped


def test_reports_merge_gzipped_or_not_a_later_case_replacing_an_earlier_one(tmp_path):
    import gzip
    import json

    matrix = script("support_matrix")
    first, later = _case("llama", "tp4", status="fail"), _case("llama", "tp4")
    (tmp_path / "a.json").write_text(json.dumps({"cases": [first], "nproc": 4}))
    with gzip.open(tmp_path / "b.json.gz", "wt") as handle:
        json.dump({"cases": [later], "nproc": 4}, handle)
    cases, meta = matrix.merged([str(tmp_path / "a.json"), str(tmp_path / "b.json.gz")])
    assert list(cases.values()) == [later] and meta == {"nproc": 4}
