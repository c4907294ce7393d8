"""A local world's own skips (`rank.localrun`): which reason a case is given before anything is built."""

from paracheck.adapters.transformers import cases as tf_cases
from paracheck.adapters.transformers.layout import TfLayout
from paracheck.domain.backends import get_backend
from paracheck.domain.case import Case
from paracheck.domain.records import LOCAL_WORLD_SKIP, RankStatus
from paracheck.rank.localrun import LATER_OFF, run_local_case


def test_a_control_that_does_not_apply_is_skipped_in_its_own_words_not_the_local_worlds(tmp_path):
    """A control refusing the layout (`Control.applies`) was given a local world's reason first: "left out" for a
    steps-only control, the expert-parallel limit on an `ep` layout. Its own refusal is what gloo says, so it is
    the reason here too; a control that applies keeps the local world's words. Nothing is built (no world reached)."""
    world = type("World", (), {"ranks": [0, 1, 2, 3]})()
    factory = tf_cases.factory_of("qwen3_moe")

    def reason(layout, control):
        case = Case("qwen3_moe", factory, layout, library="transformers", control=control)
        results = run_local_case(0, case, get_backend("gloo"), world, str(tmp_path), str(tmp_path / "case"))
        assert {r.status for r in results} == {RankStatus.SKIP} and len({r.reason for r in results}) == 1
        return results[0].reason

    assert "has no dp_replicate dimension" in reason(TfLayout(tp=4), "tf-decay-twice")
    assert reason(TfLayout(dpr=2, fsdp=2), "tf-decay-twice").endswith(LATER_OFF)
    assert "has no pipeline" in reason(TfLayout(fsdp=4, ep=4), "tf-pp-stage-short")
    assert reason(TfLayout(fsdp=4, ep=4), "tf-router-topk-on-shard").startswith(LOCAL_WORLD_SKIP)
