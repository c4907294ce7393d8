"""structure.collectives: the pure check over per-group counts, the counter, and one real gloo world."""

import json
import os
from collections import Counter

import pytest

from paracheck.adapters.diffusers.collectives import CallShape, Counts, count_collectives, expected_groups, check_counts
from paracheck.adapters.diffusers.layout import DiffusersLayout
from tests.support import ROOT


def ops(items):
    return Counter({(k, tuple(g)): n for k, g, n in items})


def counts(rank, outside, per_call=(), calls=2, local=0):
    """`calls` attention calls dispatched with the CP config, each issuing `per_call`; `local` without."""
    attention = Counter()
    if calls:
        attention[CallShape.of(True, ops(per_call))] = calls
    if local:
        attention[CallShape.of(False, Counter())] = local
    return Counts(rank, ops(outside), attention)


# Measured in real 4-rank gloo runs (`paracheck run`), tiny Flux at 4 heads: 2 attention calls; each Ulysses
# call 4 all-to-alls (q, k, v, out), each ring call 1 KV gather; one output gather; 5 rowwise all-reduces.
U4 = dict(outside=[("all_gather", [0, 1, 2, 3], 1)], per_call=[("all_to_all", [0, 1, 2, 3], 4)])
TP4 = dict(outside=[("all_reduce", [0, 1, 2, 3], 5)], calls=0, local=2)
TP2XU2_RANK2 = dict(outside=[("all_gather", [2, 3], 1), ("all_reduce", [0, 2], 5)], per_call=[("all_to_all", [2, 3], 4)])
R4 = dict(outside=[("all_gather", [0, 1, 2, 3], 1)], per_call=[("all_gather", [0, 1, 2, 3], 1)])
R2XU2_RANK1 = dict(outside=[("all_gather", [0, 1, 2, 3], 1)],
                   per_call=[("all_gather", [1, 3], 1), ("all_to_all", [0, 1], 4)])


def test_measured_counts_pass():
    assert check_counts(counts(1, **U4), DiffusersLayout.parse("u4")).status == "pass"
    assert check_counts(counts(1, **TP4), DiffusersLayout.parse("tp4")).status == "pass"
    assert check_counts(counts(2, **TP2XU2_RANK2), DiffusersLayout.parse("tp2xu2")).status == "pass"
    assert check_counts(counts(1, **R4), DiffusersLayout.parse("r4")).status == "pass"
    assert check_counts(counts(1, **R2XU2_RANK1), DiffusersLayout.parse("r2xu2")).status == "pass"


def test_cross_attention_without_the_config_communicates_nothing_and_passes():
    """Wan's attn2 holds the config but dispatches its text cross-attention without it (K/V are whole)."""
    wan = check_counts(counts(1, **U4, local=2), DiffusersLayout.parse("u4"))
    assert wan.status == "pass" and "2 local attention calls" in wan.detail


def test_ulysses_without_alltoall_fails():
    """skip-processor-config: attention never gets the config, so it never does the all-to-all."""
    result = check_counts(counts(0, U4["outside"], calls=0, local=2), DiffusersLayout.parse("u4"))
    assert result.status == "fail"
    assert ("no attention call was dispatched with the CP config (2 ran on this rank's shard alone), so no "
            "all-to-all over the Ulysses group [0, 1, 2, 3]") in result.detail


def test_a_backend_that_ignores_the_config_fails():
    """cp-attention-local: the calls carry the config, yet issue nothing (each rank attends its own shard)."""
    u4 = check_counts(counts(0, U4["outside"], per_call=[]), DiffusersLayout.parse("u4"))
    assert "2 attention calls dispatched with a parallel config issued no all-to-all over the Ulysses group" in u4.detail
    r2xu2 = check_counts(counts(1, R2XU2_RANK1["outside"], per_call=[]), DiffusersLayout.parse("r2xu2"))
    assert ("issued no all-to-all over the Ulysses group [0, 1] and no KV gather or rotation over the ring "
            "group [1, 3]") in r2xu2.detail


def test_cp_layout_without_any_cp_collective_fails():
    result = check_counts(counts(0, [], calls=0, local=2), DiffusersLayout.parse("u4"))
    assert result.status == "fail" and result.detail.startswith("a CP layout issued no collective over its CP groups")


def test_a_local_attention_call_that_communicates_fails():
    stray = Counts(0, ops(U4["outside"]), Counter({CallShape.of(True, ops(U4["per_call"])): 2,
                                                   CallShape.of(False, ops([("all_gather", [0, 1, 2, 3], 1)])): 1}))
    result = check_counts(stray, DiffusersLayout.parse("u4"))
    assert "1 attention call dispatched without a parallel config issued collectives" in result.detail


def test_a_cp_attention_call_over_another_group_fails():
    # tp2xu2 rank 0: its TP group is [0, 2], its Ulysses group [0, 1].
    bad = counts(0, [("all_gather", [0, 1], 1), ("all_reduce", [0, 2], 5)],
                 per_call=[("all_to_all", [0, 1], 4), ("all_gather", [0, 2], 1)])
    assert "issued 1 all_gather over [0, 2], neither its Ulysses nor its ring group" in \
        check_counts(bad, DiffusersLayout.parse("tp2xu2")).detail


def test_parallel_attention_on_a_layout_without_cp_fails():
    result = check_counts(counts(0, TP4["outside"], per_call=[]), DiffusersLayout.parse("tp4"))
    assert "2 attention calls dispatched with a parallel config on tp4, which has no context parallelism" in result.detail


def test_alltoall_over_a_group_the_layout_lacks_fails():
    # tp2xu2 built tp-fastest while the layout says cp-fastest: rank 0's Ulysses group is [0, 2].
    bad = counts(0, [("all_gather", [0, 1], 1), ("all_reduce", [0, 1], 5)], per_call=[("all_to_all", [0, 2], 4)])
    result = check_counts(bad, DiffusersLayout.parse("tp2xu2"))
    assert result.status == "fail"
    assert "no all-to-all over the Ulysses group [0, 1]" in result.detail
    assert "all-to-all over the tp group [0, 2]" in result.detail
    assert "all-reduce over the ulysses/cp group [0, 1]" in result.detail


def test_tp_without_allreduce_fails():
    assert "no all-reduce over the TP group" in check_counts(counts(0, [], calls=0), DiffusersLayout.parse("tp4")).detail


def test_ring_alone_needs_kv_gathers_and_the_output_gather():
    layout = DiffusersLayout.parse("r4")
    missing_output = check_counts(counts(1, [], per_call=R4["per_call"]), layout)
    assert missing_output.detail == "the output is not gathered over the CP group [0, 1, 2, 3]"
    # The output gather outside attention does not stand in for the KV gathers inside it.
    no_kv = check_counts(counts(1, [("all_gather", [0, 1, 2, 3], 3)], per_call=[]), layout)
    assert "issued no KV gather or rotation over the ring group [0, 1, 2, 3]" in no_kv.detail


def test_unknown_group_and_self_groups():
    unknown = Counts(0, Counter({("all_reduce", None): 1}))
    assert "unknown group" in check_counts(unknown, DiffusersLayout.parse("tp4")).detail
    ok = dict(TP4, outside=TP4["outside"] + [("all_gather", [1], 3)])  # a group of one moves nothing
    assert check_counts(counts(1, **ok), DiffusersLayout.parse("tp4")).status == "pass"


def test_expected_groups():
    assert expected_groups(DiffusersLayout.parse("tp2xr2xu2"), 5) == {
        "tp": (1, 5), "ulysses": (4, 5), "ring": (5, 7), "cp": (4, 5, 6, 7)}


def test_counts_roundtrip():
    c = counts(2, **TP2XU2_RANK2, local=1)
    assert Counts.from_json(c.to_json()) == c
    assert c.count("all_to_all") == 8 and c.calls(parallel=True) == 2 and c.calls(parallel=False) == 1


def test_counter_records_groups_under_the_fake_pg():
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from paracheck.adapters.diffusers.simulate.fakeworld import fake_world

    with fake_world(1, 4):
        group = dist.new_group([0, 1])
        with count_collectives() as c:
            for out in (funcol.all_to_all_single(torch.ones(4, device="meta"), None, None, group),
                        funcol.all_reduce(torch.ones(2), "sum", dist.group.WORLD)):
                torch.ops._c10d_functional.wait_tensor(out.elem if hasattr(out, "elem") else out)
            # c10d ops box their group (diffusers' mask and uneven gathers use `dist.all_gather`)
            dist.all_gather([torch.empty(2), torch.empty(2)], torch.ones(2), group=group)
    assert c.ops == Counter({("all_to_all", (0, 1)): 1, ("all_reduce", (0, 1, 2, 3)): 1, ("all_gather", (0, 1)): 1})
    assert c.outside == c.ops and not c.attention


def test_attention_calls_are_told_apart_by_the_config_they_were_dispatched_with():
    """The observer wraps the registry's backends, so a call dispatched by diffusers is seen with its config."""
    import torch
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    from paracheck.adapters.diffusers.library import observed_attention

    q = torch.ones(1, 4, 2, 8, device="meta")
    with count_collectives(0, observed_attention) as c:
        dispatch_attention_fn(q, q, q, backend="native")
        dispatch_attention_fn(q, q, q, backend="native")
    assert c.calls(parallel=False) == 2 and c.calls(parallel=True) == 0 and not c.ops
    assert c.to_json()["attention"] == [{"parallel": False, "calls": 2, "per_call": []}]


@pytest.mark.slow
def test_real_gloo_world_counts_and_the_skip_processor_config_control(monkeypatch, tmp_path):
    # The benchmark's own command, in this process: its ranks fork from the session's preloaded fork server.
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import collectives_gloo

    out = tmp_path / "rows.json"
    assert collectives_gloo.main(["--cases", "u4,u4:skip-processor-config", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    plain = [r for r in rows if r["case"] == "u4"]
    control = [r for r in rows if r["case"] != "u4"]
    assert [r["verdict"] for r in plain] == ["pass"] * 4
    assert all(r["max_abs"] < 1e-5 for r in plain)
    # CommDebugMode sees diffusers' funcol all-to-alls too, but not their groups.
    assert all(r["comm_debug_mode"] == {"c10d_functional.all_gather_into_tensor": 1,
                                        "c10d_functional.all_to_all_single": 8} for r in plain)
    assert [r["verdict"] for r in control] == ["fail"] * 4
    assert all("no all-to-all over the Ulysses group" in r["detail"] for r in control)
