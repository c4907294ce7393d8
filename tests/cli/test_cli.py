"""Bad input exits 2 with a message naming the argument and the rule; no rank is started."""


import pytest

from paracheck.cli.main import main
from tests.support import SPECS


@pytest.mark.parametrize("argv, fragment", [
    (["run", "--layouts", "tp2xu4"], "--layouts tp2xu4: its world size is 8"),
    (["run", "--layouts", "tp2xq2"], "part 'q2'"),
    (["run", "--models", "sd3"], "--models sd3: unknown; fixtures are flux"),
    (["run", "--nproc", "0"], "--nproc 0: must be >= 1"),
    (["run", "--nproc", "1"], "one rank has no parallel layout"),
    (["run", "--backend", "mpi"], "--backend 'mpi'"),
    (["run", "--route", "magic"], "--route 'magic'"),
    (["run", "--order", "sideways"], "--order 'sideways'"),
    (["run", "--timeout", "0"], "--timeout 0"),
    (["run", "--spec", "no_such_module_xyz:make"], "importing 'no_such_module_xyz' failed"),
    (["run", "--spec", "nocolon"], "write MODULE:FUNCTION"),
    (["run", "--spec", f"{SPECS}:raises_everywhere"], "calling the factory raised RuntimeError"),
    (["run", "--spec", f"{SPECS}:wrong_shape"], "must return (model_class, init_dict, inputs), got a tuple of 2"),
    (["run", "--spec", f"{SPECS}:missing"], "has no callable 'missing'"),
    (["run", "--report-json", "/no/such/dir/r.json"], "--report-json /no/such/dir/r.json: folder /no/such/dir"),
    (["run", "--only-control", "skip-cp-hooks"], "--only-control needs --controls"),
    (["run", "--controls", "--only-control", "nope"], "--only-control 'nope'"),
    (["topology", "--backend", "gloo", "--world", "0", "--heads", "8"], "--world 0"),
    (["run", "--models", "wan", "--layouts", "tp2xu2"], "--models wan takes none of --layouts tp2xu2 (tp2xu2: "
                                                        "WanTransformer3DModel has no _tp_plan"),
    (["run", "--models", "wan,ltx", "--layouts", "tp2xu2,u4"], "--layouts tp2xu2 fits none of --models wan,ltx"),
    (["run", "--spec", f"{SPECS}:no_heads", "--layouts", "tp4"], "no integer num_attention_heads"),
    (["run", "--attention-backend", "nope"], "--attention-backend 'nope': must be auto, paracheck_cpu_lse or one of"),
    (["run", "--variants", "batch3"], "--variants 'batch3': batch3: variants are base, batch2, masked, uneven"),
    (["run", "--dtype", "fp8"], "--dtype 'fp8': must be one of fp32, bf16, fp16"),
    (["run", "--spec", f"{SPECS}:flux_spec", "--models", "flux"], "--models with --spec"),
    (["run", "--models", "llama,flux", "--layouts", "dpr4,zz4"], "'zz4' is no layout of any library in this run "
                                                                 "(transformers: layout 'zz4'"),
    (["run", "--models", "llama,flux", "--layouts", "dpr4"], "none is a diffusers layout, for flux"),
    (["run", "--local-world", "0"], "--local-world 0: must be >= 1"),
    (["run", "--local-world", "8", "--nproc", "4"], "--local-world 8 --nproc 4: a local world's ranks are its N"),
    (["run", "--local-world", "8", "--layouts", "tp4"], "--layouts tp4: its world size is 4"),
])
def test_usage_errors_exit_2(argv, fragment, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err, err


def test_named_models_cross_named_layouts():
    """flux on tp2xu2 and wan on u4 from one command: the misfit pairs are cases too, skipped on the ranks."""
    from paracheck.domain.backends import get_backend
    from paracheck.cli.main import parser, build_cases

    args = parser().parse_args(["run", "--models", "flux,wan", "--layouts", "tp2xu2,u4", "--variants", "base"])
    pairs = {(c.model, c.layout.name) for c in build_cases(args, get_backend("gloo"))}
    assert pairs == {("flux", "tp2xu2"), ("flux", "u4"), ("wan", "tp2xu2"), ("wan", "u4")}


def test_each_library_of_a_run_takes_the_layouts_its_grammar_reads():
    """dpr4 is transformers' alone, u4 diffusers' alone, tp4 both's: one command gives each its own."""
    from paracheck.domain.backends import get_backend
    from paracheck.cli.main import parser, build_cases

    args = parser().parse_args(["run", "--models", "llama,flux", "--layouts", "dpr4,tp4,u4", "--variants", "base",
                                "--all"])
    pairs = {(c.model, c.layout.name) for c in build_cases(args, get_backend("gloo"))}
    assert pairs == {("llama", "dpr4"), ("llama", "tp4"), ("flux", "tp4"), ("flux", "u4")}


def test_nccl_without_gpus_names_the_device_count(capsys, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert main(["run", "--backend", "nccl"]) == 2
    assert "--nproc 4: backend nccl sees only 0 devices" in capsys.readouterr().err


def test_topology_lists_reasons(capsys):
    assert main(["topology", "--backend", "neuron", "--world", "8", "--heads", "56"]) == 0
    out = capsys.readouterr().out
    assert "u8" in out and "tp2xu4" in out
    assert "ulysses degree 2" in out  # tp4xu2: Neuron's all-to-all group sizes
    assert main(["topology", "--backend", "gloo", "--world", "4", "--heads", "6", "--layout", "tp2xu2"]) == 1
    assert "nearest fit: 8" in capsys.readouterr().out


def test_all_is_every_librarys_fixtures_and_the_groups_split_them():
    from paracheck.adapters.diffusers.fixtures_index import FIXTURES, PIPELINE_FIXTURES
    from paracheck.adapters.transformers.fixtures import FIXTURES as TRANSFORMERS_FIXTURES
    from paracheck.domain.registry import select

    every = [name for name, _ in select("all")]
    diffusers = list(FIXTURES) + list(PIPELINE_FIXTURES)
    assert every == diffusers + list(TRANSFORMERS_FIXTURES)  # transformers is in the test extra
    assert [name for name, _ in select("diffusers")] == diffusers
    assert [name for name, _ in select("pipelines")] == list(PIPELINE_FIXTURES)
    assert [name for name, _ in select("transformers")] == list(TRANSFORMERS_FIXTURES)


def test_unset_variants_give_the_transformers_fixtures_their_base_inputs_only():
    from paracheck.cli.main import build_cases, parser
    from paracheck.domain.backends import get_backend

    args = parser().parse_args(["run", "--models", "llama,flux", "--layouts", "all"])
    cases = build_cases(args, get_backend("gloo"))
    assert {c.variant for c in cases if c.library == "transformers"} == {"base"}
    assert {c.variant for c in cases if c.library == "diffusers"} == {"base", "batch2", "uneven"}
    args = parser().parse_args(["run", "--models", "llama", "--variants", "all"])
    assert len({c.variant for c in build_cases(args, get_backend("gloo"))}) > 1


@pytest.mark.parametrize("given, local_world, expected", [
    (None, None, 120.0), (None, 2, 120.0), (None, 4, 120.0), (None, 16, 480.0), (None, 32, 960.0),
    (30.0, 32, 30.0), (600.0, None, 600.0),
])
def test_a_local_worlds_default_timeout_grows_with_the_ranks_one_process_runs(given, local_world, expected):
    """One process does every rank's work in a local world: a 16-rank case under load ran past the 4-rank default
    and was reported a hang; a timeout the user gives is kept as given."""
    from paracheck.cli.common import check_timeout

    assert check_timeout(given, local_world) == expected
