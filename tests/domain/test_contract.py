"""The adapter contract (`domain.contract`, `domain.adapter.ADAPTER` and `CASE_BODY`): what the registry refuses
when an adapter loads, in one line naming the adapter, the member and the rule; the bound view's defaults; and one
conformance suite every registered adapter passes, one found by entry point from outside the package included."""

from __future__ import annotations

import pytest

from paracheck.domain import registry
from paracheck.domain.adapter import ADAPTER, CASE_BODY, CaseRequest
from paracheck.domain.case import Case
from paracheck.domain.contract import ContractError, Member, Spec
from paracheck.domain.control import Control
from paracheck.domain.records import CheckId, Status
from tests import contract_toy


@pytest.fixture
def toy_registered(tmp_path, monkeypatch):
    """tests/contract_toy.py's adapter, registered as a third package would: a dist-info entry point."""
    info = tmp_path / "toy_adapter-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-adapter\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[paracheck.adapters]\ntoy = tests.contract_toy:ADAPTER\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.adapters.cache_clear()
    yield registry.adapters()
    monkeypatch.undo()
    registry.adapters.cache_clear()


def test_an_adapter_outside_paracheck_is_found_by_its_entry_point(toy_registered):
    """The seam: a package of its own declares an adapter in the `paracheck.adapters` group and the host finds it,
    with nothing in paracheck naming it."""
    assert "toy" in toy_registered and {"diffusers", "transformers", "torch"} <= set(toy_registered)
    assert registry.select("toy") == [("toy1", "tests.contract_toy:make")]
    assert registry.library_of("tests.contract_toy:make") == "toy"


def _registered(toy: str, tmp_path, monkeypatch, source: str):
    """The registry's answer for a module `source` whose ADAPTER is registered under the name `toy`."""
    module = f"{toy}_{tmp_path.name}"  # a module name of its own per test: Python keeps what it imported
    (tmp_path / f"{module}.py").write_text(source)
    info = tmp_path / f"{toy}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {toy}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[paracheck.adapters]\n{toy} = {module}:ADAPTER\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.adapters.cache_clear()
    try:
        return registry.adapters()
    finally:
        monkeypatch.undo()
        registry.adapters.cache_clear()


def test_an_adapter_lacking_a_required_member_is_refused_in_one_line(tmp_path, monkeypatch):
    source = "class Half:\n    name = 'half'\n    dtypes = ('fp32',)\n    def fixtures(self):\n        return {}\nADAPTER = Half()\n"
    with pytest.raises(registry.AdapterError) as info:
        _registered("half", tmp_path, monkeypatch, source)
    message = str(info.value)
    assert "\n" not in message and "'half'" in message and ":ADAPTER)" in message
    assert "columns: missing; a required member, an attribute" in message and "more)" in message


def _toy_with(extra: str) -> str:
    return "from tests.contract_toy import ToyAdapter\nclass Odd(ToyAdapter):\n" + extra + "\nADAPTER = Odd()\n"


@pytest.mark.parametrize("extra, rule", [
    ("    name = 'toy'\n    def shard_everything(self):\n        return 1",
     "shard_everything: not a member the contract declares"),
    ("    name = 'toy'\n    def case_options(self):\n        return []",
     "case_options: must be a method (case); it takes (no parameters)"),
    ("    name = 'toy'\n    def will_run(self, case, layout):\n        return True",
     "will_run: must be a method (case); it takes (case, layout)"),
    ("    name = 'toy'\n    columns = staticmethod(lambda: ())",
     "columns: must be an attribute, not a method"),
])
def test_an_unknown_member_or_a_wrong_signature_is_refused_by_name(tmp_path, monkeypatch, extra, rule):
    with pytest.raises(registry.AdapterError, match=rule.replace("(", r"\(").replace(")", r"\)")):
        _registered("toy", tmp_path, monkeypatch, _toy_with(extra))


def test_the_bound_view_gives_the_hosts_defaults_and_no_undeclared_member():
    bound = ADAPTER.bind(contract_toy.ADAPTER, "toy")
    case = Case("toy1", "tests.contract_toy:make", contract_toy.ADAPTER.parse_layout("u2"), library="toy")
    assert bound.provides("will_run") and not bound.provides("generates")
    assert bound.generates(case) is False and bound.class_name(case) == "" and bound.models_option(case) is None
    assert bound.draw_options(None, None, False) == []
    with pytest.raises(NotImplementedError, match="the toy adapter has no sweep"):
        bound.sweep(None)
    with pytest.raises(AttributeError, match="'shard' is not a declared member"):
        bound.shard
    with pytest.raises(ContractError, match="'shard' is not a declared member"):
        bound.provides("shard")


def test_a_case_body_without_an_optional_pass_answers_with_a_named_skip():
    class Body:
        def __init__(self):
            self.model = object()  # state of its own: not a member

    for member in CASE_BODY.members:
        if member.required:
            setattr(Body, member.name, lambda self: None)
    bound = CASE_BODY.bind(Body(), "toy")
    assert not bound.provides("steps")
    [check] = bound.steps()
    assert (check.id, check.status) == (CheckId.STEPS, Status.SKIP)
    assert check.detail == "the toy adapter has no parity.steps pass"


def test_a_spec_names_every_problem_and_takes_parameters_by_position():
    spec = Spec("thing", (Member("run", ("a", "b")), Member("size", None)))

    class Fits:
        size = 3

        def run(self, x, y, z=0):  # its own names, one more with a default
            return x

    class Breaks:
        def run(self, x):
            return x

    assert spec.problems(Fits(), "fits") == []
    assert spec.problems(Breaks(), "breaks") == [
        "thing 'breaks': run: must be a method (a, b); it takes (x)",
        "thing 'breaks': size: missing; a required member, an attribute"]


# The conformance suite: what the host relies on, for every registered adapter and the one from outside.

@pytest.fixture(params=["diffusers", "transformers", "torch", "toy"])
def adapter(request, toy_registered):
    return toy_registered[request.param]


def test_conformance_the_declared_attributes(adapter):
    assert adapter.name in registry.adapters()
    assert adapter.dtypes and set(adapter.dtypes) <= {"fp32", "bf16", "fp16"}
    assert adapter.columns and all(isinstance(c, CheckId) for c in adapter.columns)
    assert isinstance(adapter.installed(), bool)
    assert adapter.unsupported() is None or isinstance(adapter.unsupported(), str)
    assert adapter.variants() and all(isinstance(v, str) for v in adapter.variants())


def test_conformance_fixtures_controls_and_mixins_are_what_the_host_reads(adapter):
    assert all(isinstance(k, str) and ":" in v for k, v in adapter.fixtures().items())
    assert all(isinstance(c, Control) and c.name == k for k, c in adapter.controls().items())
    assert all(":" in path for path in adapter.mixins().values())


def test_conformance_a_fixture_expands_to_cases_the_host_can_replay(adapter):
    if not adapter.installed() or not adapter.fixtures():
        pytest.skip(f"{adapter.name}: no bundled fixture here")
    name, factory = next(iter(adapter.fixtures().items()))
    cases = adapter.expand(CaseRequest(models=[(name, factory)], layouts="all", nproc=2))
    assert cases and all(c.library == adapter.name and c.model == name for c in cases)
    for case in cases:
        assert adapter.parse_layout(case.layout.name, "cp-fastest").name == case.layout.name  # the grammar round trips
        assert all(isinstance(o, str) for o in adapter.case_options(case))
        assert isinstance(adapter.will_run(case), bool) and isinstance(adapter.generates(case), bool)
        assert isinstance(adapter.class_name(case), str)
        assert case == Case.from_json(case.to_json(), lambda library, text, order: adapter.parse_layout(text, order))


def test_a_control_planted_once_per_rank_is_refused_where_its_adapter_does_not_say_it_can(monkeypatch):
    """`Control.per_rank` asks the adapter to run its planter once per rank in a local world; an adapter that does
    not (a plant handed to the library once for every rank) would plant another bug there, silently. The registry
    asks `per_rank_refusal` as it gathers the controls: an adapter that does not answer refuses (the host's default),
    one that names a reason refuses with it, one that answers None has the control listed."""
    swap = Control("toy-swap", "a shard picked by rank", (CheckId.FORWARD,), lambda layout: None, per_rank=True)

    class Planting(contract_toy.ToyAdapter):
        def controls(self):
            return {"toy-swap": swap}

    class Honouring(Planting):
        def per_rank_refusal(self, name):
            return None

    class Refusing(Planting):
        def per_rank_refusal(self, name):
            return f"{name} is planted by a plan rule"

    for adapter, why in ((Planting(), "does not say it plants a control once per rank"),
                         (Refusing(), "toy-swap is planted by a plan rule"), (Honouring(), None)):
        monkeypatch.setattr(registry, "adapters", lambda adapter=adapter: {"toy": ADAPTER.bind(adapter, "toy")})
        if why is None:
            assert registry.controls("toy") == {"toy-swap": swap}
            continue
        with pytest.raises(registry.AdapterError, match=f"adapter 'toy': control 'toy-swap' asks to be planted once "
                           f"per rank .*refuses: .*{why}"):
            registry.controls()


def test_every_adapter_says_which_of_its_controls_it_plants_once_per_rank():
    """Each adapter plants once per rank only what its planter plants after parallelizing (torch's `PLANTS`,
    diffusers' planter, transformers' `after_load`): a plan rule, an attention fault or an optimizer-loop hook is
    handed on once for every rank, refused by name; every control the kit declares per rank is honoured."""
    every = {name: registry.adapter(name) for name in ("torch", "diffusers", "transformers")}
    assert every["transformers"].per_rank_refusal("tf-vlm-tower-partial") is None
    assert "by its tp_plan, handed to transformers" in every["transformers"].per_rank_refusal("tf-norm-replicate")
    assert "trainer_plant" in every["transformers"].per_rank_refusal("tf-clip-local-norm")
    assert "attention backend" in every["diffusers"].per_rank_refusal("ring-drop-merge")
    assert "plant_cache" in every["diffusers"].per_rank_refusal("cache-local-key")
    assert every["diffusers"].per_rank_refusal("drift-grows") is None
    assert "optimizer loop" in every["torch"].per_rank_refusal("torch-clip-local-norm")
    per_rank = [c for c in registry.controls().values() if c.per_rank]
    assert {"torch-shard-swap", "global-rank-shard-index"} <= {c.name for c in per_rank}
