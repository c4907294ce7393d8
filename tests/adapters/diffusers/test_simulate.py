"""`paracheck topology --simulate`: large worlds, one rank at a time, under the fake process group on meta.

The two seed findings are reproduced from the meshes and process groups the library really builds:
Neuron's strided Ulysses groups under --order tp-fastest, and TP shards picked by global rank.
"""

import pytest
import torch

from paracheck.cli.main import main
from paracheck.fixtures import flux
from paracheck.adapters.diffusers.layout import DiffusersLayout, layouts_for
from paracheck.launch.attribution import ranks_text
from paracheck.adapters.diffusers.simulate.shardledger import (
    Provenance,
    expected_intervals,
    merge_intervals,
    shard_index,
    shard_ledger,
    sub_intervals,
)
from paracheck.adapters.diffusers.simulate.engine import simulate, simulate_layout


def _flux(heads):
    cls, init, inputs = flux()
    return cls, dict(init, num_attention_heads=heads), inputs


# -- seed finding 1: strided all-to-all groups on Neuron ---------------------------------------


@pytest.mark.parametrize("name", ["tp4xu4", "tp2xu8"])
def test_tp_fastest_gives_strided_alltoall_groups_on_neuron(name):
    cls, init, _ = _flux(16)
    strided = simulate_layout(cls, init, DiffusersLayout.parse(name, "tp-fastest"), "neuron")
    assert strided.status == "no"
    assert strided.failures["backend.groups"]["ranks"] == list(range(16))
    assert "strided" in strided.failures["backend.groups"]["detail"]
    assert not strided.structure_failed  # the library built what was asked; the platform cannot run it
    contiguous = simulate_layout(cls, init, DiffusersLayout.parse(name, "cp-fastest"), "neuron")
    assert contiguous.status == "ok", contiguous.reason
    assert {"structure.mesh", "structure.cp_hooks", "structure.processor_config", "structure.tp_shards",
            "backend.groups"} <= set(contiguous.passed)


def test_nccl_takes_strided_groups():
    cls, init, _ = _flux(16)
    assert simulate_layout(cls, init, DiffusersLayout.parse("tp4xu4", "tp-fastest"), "nccl").status == "ok"


def test_derived_verdict_agrees_with_the_rule_table():
    """Backend.problems is written by hand; the simulation derives Neuron's verdict from real groups."""
    cls, init, _ = _flux(48)
    for order in ("cp-fastest", "tp-fastest"):
        for result in simulate(cls, init, "neuron", 8, order=order):
            assert not result.notes, (result.layout, order, result.notes)
            assert not result.structure_failed, (result.layout, result.reason)


# -- seed finding 2: TP shards by global rank ----------------------------------------------------


def test_global_rank_shard_index_detected_by_index_at_16():
    cls, init, _ = _flux(16)
    layout = DiffusersLayout.parse("tp4xu4")  # TP mesh of 4 inside a world of 16
    result = simulate_layout(cls, init, layout, "neuron", control="global-rank-shard-index")
    assert result.detected
    failing = result.failures["structure.tp_shards"]["ranks"]
    # Exactly the ranks whose global rank mod tp differs from their TP-mesh coordinate.
    assert failing == [r for r in range(16) if r % 4 != layout.coords(r)["tp"]]
    assert "holds TP shard 1 of 4, its TP-mesh coordinate is 0" in result.failures["structure.tp_shards"]["detail"]
    assert simulate_layout(cls, init, layout, "neuron").status == "ok"


def test_global_rank_shard_index_detected_at_64():
    cls, init, _ = _flux(4)
    layout = DiffusersLayout.parse("tp4xr16")
    result = simulate_layout(cls, init, layout, "nccl", control="global-rank-shard-index")
    assert result.detected and result.ranks == 64
    assert result.failures["structure.tp_shards"]["ranks"] == [r for r in range(64)
                                                               if r % 4 != layout.coords(r)["tp"]]


def test_control_that_cannot_show_is_skipped():
    cls, init, _ = _flux(4)
    result = simulate_layout(cls, init, DiffusersLayout.parse("tp4"), "nccl", control="global-rank-shard-index")
    assert result.status == "skip" and "mod tp equals" in result.reason


# -- fitting and static rules -------------------------------------------------------------------


def test_unfit_layouts_are_not_simulated():
    cls, init, _ = _flux(24)
    result = simulate_layout(cls, init, DiffusersLayout.parse("tp16"), "nccl")
    assert result.status == "unfit" and "nearest fit: 32" in result.reason and result.ranks == 0


def test_minimax_h3_has_no_tp_plan_and_takes_ulysses_8():
    from paracheck.adapters.diffusers.simulate.specs import minimax_h3

    cls, init, _ = minimax_h3()
    assert "no _tp_plan" in simulate_layout(cls, init, DiffusersLayout.parse("tp2xu4"), "neuron").reason
    result = simulate_layout(cls, init, DiffusersLayout.parse("u8"), "neuron")
    assert result.status == "ok", result.reason


def test_gloo_takes_ring():
    """paracheck's own CPU attention op returns the log-sum-exp, so gloo runs ring; no group rule refuses it."""
    cls, init, _ = _flux(4)
    result = simulate_layout(cls, init, DiffusersLayout.parse("r4"), "gloo")
    assert result.status == "ok" and not result.failures


# -- collectives on meta under the fake process group -------------------------------------------


def test_collectives_on_meta():
    cls, init, inputs = _flux(4)
    for name in ("u4", "tp2xu2", "r4"):
        result = simulate_layout(cls, init, DiffusersLayout.parse(name), "nccl", collectives=True, inputs=inputs)
        assert "structure.collectives" in result.passed, (name, result.failures)
    counts = result.counts[1]  # r4, rank 1: KV gathered once per attention call, then the output gather
    gather = [{"kind": "all_gather", "group": [0, 1, 2, 3], "count": 1}]
    assert counts["attention"] == [{"parallel": True, "calls": 2, "per_call": gather}]
    assert counts["outside"] == gather


def test_wan_cross_attention_runs_local_on_meta_too():
    """Wan's text cross-attention is dispatched without the config, as in the real run; its CP hooks warn
    through `warning_once`, which the meta forward must supply as the real run does."""
    from paracheck.fixtures import wan

    cls, init, inputs = wan()
    result = simulate_layout(cls, dict(init, num_attention_heads=4), DiffusersLayout.parse("u4"), "nccl", collectives=True,
                             inputs=inputs, ranks=[2])
    assert "structure.collectives" in result.passed, result.failures
    assert {"parallel": False, "calls": 2, "per_call": []} in result.counts[2]["attention"]


def test_skip_processor_config_fails_collectives_on_meta():
    cls, init, inputs = _flux(4)
    result = simulate_layout(cls, init, DiffusersLayout.parse("u4"), "nccl", collectives=True, inputs=inputs,
                             control="skip-processor-config")
    assert result.detected
    assert "no all-to-all over the Ulysses group" in result.failures["structure.collectives"]["detail"]


# -- the shard ledger, pure ---------------------------------------------------------------------


def test_intervals():
    assert merge_intervals([(0, 2), (2, 3), (9, 1)]) == ((0, 5), (9, 1))
    assert sub_intervals(((10, 4), (20, 4)), 2, 6) == ((12, 2), (20, 2))

    class Spec:
        dim, block_sizes = 0, [8, 16]

    assert expected_intervals(Spec, 1, 4) == ((2, 2), (12, 4))
    assert shard_index(Spec, ((2, 2), (12, 4)), 4) == 1
    assert shard_index(Spec, ((0, 4),), 4) is None


def test_ledger_follows_narrow_cat_and_copy_into_a_view():
    ledger = shard_ledger()
    full = torch.empty(8, 4, device="meta")
    local = torch.empty(2, 4, device="meta")
    ledger.register(full, "w")
    with ledger:
        piece = torch.cat([full.narrow(0, 4, 2)], dim=0)
        view = local.view_as(local)
        view.copy_(piece)
        chunks = torch.chunk(full.detach(), 4, dim=0)
    assert ledger.provenance(local) == Provenance("w", 0, ((4, 2),))
    assert [ledger.provenance(c).intervals for c in chunks] == [((0, 2),), ((2, 2),), ((4, 2),), ((6, 2),)]


def test_neuron_alltoall_rule():
    """One rule for layouts (`backend_problems`) and for the groups a simulation finds (`group_problems`)."""
    from paracheck.domain.backends import get_backend
    from paracheck.adapters.diffusers.layout import DiffusersLayout, backend_problems

    neuron = get_backend("neuron")
    assert neuron.group_problems([4, 5, 6, 7]) == [] and neuron.group_problems(list(range(32, 64))) == []
    assert any("strided" in p for p in neuron.group_problems([0, 4, 8, 12]))
    assert any("4, 8, 16" in p for p in neuron.group_problems([0, 1]))
    assert get_backend("gloo").group_problems([0, 4]) == []
    for size in (2, 4, 6, 8, 16, 32, 48, 64):
        by_layout = not any("ulysses degree" in p for p in backend_problems(neuron, DiffusersLayout.parse(f"u{size}")))
        assert by_layout == (neuron.group_problems(list(range(size))) == []), size
    assert ranks_text([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


# -- command line -------------------------------------------------------------------------------


def test_cli_reproduces_the_neuron_finding(capsys):
    argv = ["topology", "--simulate", "--backend", "neuron", "--world", "16", "--models", "flux", "--heads", "16",
            "--layout", "tp4xu4"]
    assert main(argv + ["--order", "tp-fastest"]) == 1
    assert "all-to-all group [0, 4, 8, 12] is strided" in capsys.readouterr().out
    assert main(argv) == 0
    assert main(argv + ["--control", "global-rank-shard-index"]) == 0  # detected
    assert "detected" in capsys.readouterr().out


@pytest.mark.parametrize("argv, fragment", [
    (["--world", "256"], "--world 256: --simulate takes 2 to 128 ranks"),
    (["--world", "16", "--models", "sd3"], "--models sd3: unknown"),
    (["--world", "16", "--models", "flux", "--spec", "paracheck.adapters.diffusers.simulate.specs:flux_dev"], "--models and --spec"),
    (["--world", "16", "--route", "sharded-load"], "--route 'sharded-load'"),
    (["--world", "16", "--control", "nope"], "--control 'nope'"),
    (["--world", "16", "--heads", "0"], "--heads 0: must be >= 1"),
    (["--world", "16", "--layout", "tp4xu2"], "--layout tp4xu2: its world size is 8 (4 x 2), but --world is 16"),
    (["--world", "16", "--order", "sideways"], "--order 'sideways'"),
    (["--world", "16", "--spec", "nocolon"], "write MODULE:FUNCTION"),
])
def test_simulate_usage_errors_exit_2(argv, fragment, capsys):
    assert main(["topology", "--simulate", "--backend", "neuron", *argv]) == 2
    err = capsys.readouterr().err
    assert fragment in err, err


def test_a_layout_of_another_world_is_named_by_topologys_own_flags_with_or_without_simulate(capsys):
    """One parser for both (`layout.parse_layouts`); the table without --simulate named `run`'s --layouts and
    --nproc, flags `topology` does not have."""
    for extra in ([], ["--simulate"]):
        assert main(["topology", *extra, "--backend", "gloo", "--world", "4", "--heads", "4", "--layout", "tp2"]) == 2
        assert "--layout tp2: its world size is 2 (2), but --world is 4" in capsys.readouterr().err


def test_simulate_only_flags_and_heads_without_simulate(capsys):
    assert main(["topology", "--backend", "neuron", "--world", "8"]) == 2
    assert "--heads: required without --simulate" in capsys.readouterr().err
    assert main(["topology", "--backend", "neuron", "--world", "8", "--heads", "8", "--models", "flux"]) == 2
    assert "--models: only with --simulate" in capsys.readouterr().err


def test_every_layout_of_a_world_is_listed():
    cls, init, _ = _flux(2)
    results = simulate(cls, init, "nccl", 4)
    assert [r.layout.name for r in results] == [l.name for l in layouts_for(4)]


def test_one_simulation_judged_by_two_backends(capsys):
    from paracheck.adapters.diffusers.simulate.engine import simulate_on

    cls, init, _ = _flux(16)
    out = simulate_on(cls, init, ["neuron", "nccl"], 16, ["tp4xu4"], order="tp-fastest")
    assert out["neuron"][0].status == "no" and out["nccl"][0].status == "ok"
    assert main(["topology", "--simulate", "--backend", "neuron,nccl", "--world", "16", "--models", "flux",
                 "--heads", "16", "--layout", "tp4xu4", "--order", "tp-fastest"]) == 1
    text = capsys.readouterr().out
    assert "on neuron" in text and "on nccl" in text and "judged by neuron, nccl" in text
