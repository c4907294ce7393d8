"""structure.collectives: the pure verdict over per-group counts, the counter, and one real gloo world."""

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from paracheck.collectives import Counts, count_collectives, expected_groups, verdict
from paracheck.layout import Layout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def counts(rank, ops, calls=2):
    return Counts(rank, Counter({(k, tuple(g)): n for k, g, n in ops}), calls)


# Measured on a real 4-rank gloo world (benchmarks/collectives_gloo.py), tiny Flux at 4 heads:
# 2 attention calls, each Ulysses call 4 all-to-alls (q, k, v, out), one output gather, 5 rowwise all-reduces.
U4 = [("all_to_all", [0, 1, 2, 3], 8), ("all_gather", [0, 1, 2, 3], 1)]
TP4 = [("all_reduce", [0, 1, 2, 3], 5)]
TP2XU2_RANK2 = [("all_to_all", [2, 3], 8), ("all_gather", [2, 3], 1), ("all_reduce", [0, 2], 5)]


def test_measured_counts_pass():
    assert verdict(counts(1, U4), Layout.parse("u4")).status == "pass"
    assert verdict(counts(1, TP4), Layout.parse("tp4")).status == "pass"
    assert verdict(counts(2, TP2XU2_RANK2), Layout.parse("tp2xu2")).status == "pass"


def test_ulysses_without_alltoall_fails():
    """skip-processor-config: attention never gets the config, so it never does the all-to-all."""
    result = verdict(counts(0, [("all_gather", [0, 1, 2, 3], 1)]), Layout.parse("u4"))
    assert result.status == "fail" and "no all-to-all over the Ulysses group [0, 1, 2, 3]" in result.detail


def test_cp_layout_without_any_cp_collective_fails():
    result = verdict(counts(0, []), Layout.parse("u4"))
    assert result.status == "fail" and result.detail.startswith("a CP layout issued no collective over its CP groups")


def test_too_few_alltoalls_for_the_attention_calls():
    result = verdict(counts(0, [("all_to_all", [0, 1, 2, 3], 1), ("all_gather", [0, 1, 2, 3], 1)]), Layout.parse("u4"))
    assert result.status == "fail" and "1 all-to-alls over the Ulysses group for 2 attention calls" in result.detail


def test_alltoall_over_a_group_the_layout_lacks_fails():
    # tp2xu2 built tp-fastest while the layout says cp-fastest: rank 0's Ulysses group is [0, 2].
    bad = [("all_to_all", [0, 2], 8), ("all_gather", [0, 1], 1), ("all_reduce", [0, 1], 5)]
    result = verdict(counts(0, bad), Layout.parse("tp2xu2"))
    assert result.status == "fail"
    assert "no all-to-all over the Ulysses group [0, 1]" in result.detail
    assert "all-to-all over the tp group [0, 2]" in result.detail
    assert "all-reduce over the ulysses/cp group [0, 1]" in result.detail


def test_tp_without_allreduce_fails():
    assert "no all-reduce over the TP group" in verdict(counts(0, []), Layout.parse("tp4")).detail


def test_ring_alone_needs_kv_gathers_and_the_output_gather():
    layout = Layout.parse("r4")
    assert verdict(counts(1, [("all_gather", [0, 1, 2, 3], 3)]), layout).status == "pass"
    missing_output = verdict(counts(1, [("all_gather", [0, 1, 2, 3], 2)]), layout)
    assert "the output is not gathered over the CP group" in missing_output.detail
    hybrid = [("all_gather", [1, 3], 2), ("all_to_all", [0, 1], 8), ("all_gather", [0, 1, 2, 3], 1)]
    assert verdict(counts(1, hybrid), Layout.parse("r2xu2")).status == "pass"


def test_unknown_group_and_self_groups():
    assert "unknown group" in verdict(Counts(0, Counter({("all_reduce", None): 1}), 0), Layout.parse("tp4")).detail
    ok = TP4 + [("all_gather", [1], 3)]  # a group of one moves nothing
    assert verdict(counts(1, ok), Layout.parse("tp4")).status == "pass"


def test_expected_groups():
    assert expected_groups(Layout.parse("tp2xr2xu2"), 5) == {
        "tp": (1, 5), "ulysses": (4, 5), "ring": (5, 7), "cp": (4, 5, 6, 7)}


def test_counts_roundtrip():
    c = counts(2, TP2XU2_RANK2)
    assert Counts.from_json(c.to_json()) == c


def test_counter_records_groups_under_the_fake_pg():
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from paracheck.simulate import fake_world

    with fake_world(1, 4):
        group = dist.new_group([0, 1])
        with count_collectives() as c:
            for out in (funcol.all_to_all_single(torch.ones(4, device="meta"), None, None, group),
                        funcol.all_reduce(torch.ones(2), "sum", dist.group.WORLD)):
                torch.ops._c10d_functional.wait_tensor(out.elem if hasattr(out, "elem") else out)
    assert c.ops == Counter({("all_to_all", (0, 1)): 1, ("all_reduce", (0, 1, 2, 3)): 1})


@pytest.mark.slow
def test_real_gloo_world_counts_and_the_skip_processor_config_control(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "collectives_gloo.py"),
                           "--cases", "u4,u4:skip-processor-config", "--json", str(out)],
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
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
