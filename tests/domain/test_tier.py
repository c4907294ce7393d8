"""The quick tier (`domain.tier.quick`): a pairwise cover of the full matrix, small and deterministic."""

from dataclasses import replace

from hypothesis import given, strategies as st

from paracheck.domain.case import Case
from paracheck.adapters.diffusers.layout import DiffusersLayout
from paracheck.domain.tier import layout_kind, needs_of, quick

LAYOUTS = ["tp4", "u4", "r4", "tp2xu2", "tp2xr2", "r2xu2", "tp2", "u2", "r2"]
VARIANTS = ["base", "batch2", "masked", "uneven"]


@st.composite
def matrices(draw):
    """Models each offering some variants over some layouts (as fixtures do), controls on some layouts."""
    cases = []
    for m in range(draw(st.integers(1, 4))):
        variants = draw(st.lists(st.sampled_from(VARIANTS), min_size=1, max_size=4, unique=True))
        layouts = draw(st.lists(st.sampled_from(LAYOUTS), min_size=1, max_size=6, unique=True))
        controls = draw(st.lists(st.sampled_from(["c1", "c2"]), max_size=2, unique=True))
        for name in layouts:
            for variant in variants:
                plain = Case(f"m{m}", f"f:m{m}", DiffusersLayout.parse(name), variant=variant, library="diffusers")
                cases.append(plain)
                cases += [replace(plain, control=c) for c in controls if draw(st.booleans())]
    return cases


def _needs(cases, extras=()):
    return set().union(*(needs_of(c, extras) for c in cases if c.control is None))


@given(matrices(), st.data())
def test_the_quick_tier_covers_every_pair_and_every_known_need(cases, data):
    wanted = data.draw(st.sets(st.sampled_from(LAYOUTS)))
    extras = [("on " + name, lambda c, name=name: c.layout.name == name and c.variant != "base") for name in wanted]
    picked = quick(cases, extras)
    assert _needs(picked, extras) == _needs(cases, extras)
    assert all(c in cases for c in picked) and len(set(picked)) == len(picked)
    assert [c for c in cases if c in picked] == picked  # the matrix's order
    assert quick(list(cases), extras) == picked  # deterministic
    # Every control still runs somewhere, and only beside a chosen plain case unless it had none.
    assert {c.control for c in picked} == {c.control for c in cases}


@given(matrices())
def test_each_model_and_layout_gets_one_case_unless_a_pair_needs_another(cases):
    picked = [c for c in quick(cases) if c.control is None]
    cells = {(c.model, c.layout.name) for c in cases}
    assert {(c.model, c.layout.name) for c in picked} == cells
    extra = len(picked) - len(cells)
    # One case per cell, plus at most one per (model, variant) or (kind, variant) pair no cell's case met.
    assert extra <= len({n for n in _needs(cases) if n[0] != "model-layout"})
    if extra:  # then dropping any extra case loses a pair
        for c in picked:
            rest = [p for p in picked if p != c]
            if {(p.model, p.layout.name) for p in rest} == cells:
                assert _needs(rest) != _needs(cases), c


def test_a_case_that_only_declares_a_known_failure_again_is_left_to_the_full_matrix():
    """Two ring layouts, each with base and batch2, and a failure declared for everything on r4: r4 runs once
    (its one cell), and batch2 is met on r2, where it declares nothing again."""
    r4, r2 = DiffusersLayout.parse("r4"), DiffusersLayout.parse("r2")
    cases = [Case("m", "f:m", r4, library="diffusers"), Case("m", "f:m", r4, variant="batch2", library="diffusers"),
             Case("m", "f:m", r2, library="diffusers"), Case("m", "f:m", r2, variant="batch2", library="diffusers")]
    known = [("ring grads", lambda c: c.layout.name == "r4")]
    picked = quick(cases, known)
    assert [(c.layout.name, c.variant) for c in picked] == [("r4", "base"), ("r2", "batch2")]


def test_a_case_known_to_skip_stands_in_for_no_pair():
    """A model without a TP plan skips tp4: its cell still runs there, but its masked pair is met on u4."""
    tp4, u4 = DiffusersLayout.parse("tp4"), DiffusersLayout.parse("u4")
    cases = [Case("m", "f:m", tp4, library="diffusers"), Case("m", "f:m", tp4, variant="masked", library="diffusers"),
             Case("m", "f:m", u4, library="diffusers"), Case("m", "f:m", u4, variant="masked", library="diffusers")]
    picked = quick(cases, runs=lambda c: not c.layout.has_tp)
    assert {(c.layout.name, c.variant) for c in picked if c.layout.name == "u4"} == {("u4", "base"), ("u4", "masked")}
    assert len([c for c in picked if c.layout.name == "tp4"]) == 1


def test_a_matrix_without_plain_cases_is_kept_whole():
    cases = [Case("m", "f:m", DiffusersLayout.parse("u4"), control="c1", library="diffusers")]
    assert quick(cases) == cases


def test_a_layout_kind_drops_the_degrees():
    assert layout_kind("tp2xu2") == layout_kind("tp4xu2") == "tpxu" and layout_kind("dpr2xfsdp2") == "dprxfsdp"


def test_the_default_run_covers_the_full_matrix_and_meets_every_known_failure_it_can():
    """The real matrix: the default `paracheck run` against `--all`, and the shipped known failures. The pipeline
    cases are the adapter's own choice (one per pipeline: tests/adapters/diffusers/test_pipeline_cases.py), not the cover's."""
    from paracheck.adapters.diffusers.fixtures_index import FIXTURE_CLASSES, FIXTURES, PIPELINE_FIXTURES
    from paracheck.cli.main import build_cases, parser
    from paracheck.cli.tiers import runs
    from paracheck.domain.backends import get_backend
    from paracheck.results import known

    def models(cases):
        return [c for c in cases if c.model not in PIPELINE_FIXTURES]

    quick_cases = models(build_cases(parser().parse_args(["run"]), get_backend("gloo")))
    full = models(build_cases(parser().parse_args(["run", "--all"]), get_backend("gloo")))
    running = runs
    needs = lambda cases: set().union(*(needs_of(c, (), running) for c in cases if c.control is None))  # noqa: E731
    assert needs(quick_cases) == needs(full) and len(quick_cases) <= len(full) * 0.55
    cells = {(c.library, c.model, c.layout.name) for c in full}
    assert {(c.library, c.model, c.layout.name) for c in quick_cases} == cells
    assert len(quick_cases) - len(cells) <= 20  # one variant each, but where a skip cell or a known failure needs more
    classes = dict(zip(FIXTURES, FIXTURE_CLASSES))
    meets = lambda entry, c: running(c) and entry.may_meet(c, classes.get(c.model, ""))  # noqa: E731
    met = 0
    for entry in known.load(known.SHIPPED):
        if any(meets(entry, c) for c in full):
            met += 1
            assert any(meets(entry, c) for c in quick_cases), entry.reason
    assert met >= 15
    # Each entry is met once, not once per model it names: no model meets one entry twice where another of its
    # cases could be left to --all (Helios's uneven cases re-declared the ring and Ulysses "anything" backward).
    assert len(quick_cases) <= 116, len(quick_cases)


def test_the_fixture_plans_are_the_classes_own():
    """The plans the quick tier reads before any rank starts are the ones the installed classes carry."""
    import diffusers

    from paracheck.adapters.diffusers.fixtures_index import FIXTURE_CLASSES, FIXTURE_PLANS, FIXTURES

    from packaging.version import Version

    # The index is the newest tested release's; 0.41.0's QwenImage21 carries no plan (its cases skip at the run).
    older = {"qwenimage21": ()} if Version(diffusers.__version__) < Version("0.42.0") else {}
    for model, name in zip(FIXTURES, FIXTURE_CLASSES):
        cls = getattr(diffusers, name)
        have = tuple(p for p, attr in (("tp", "_tp_plan"), ("cp", "_cp_plan")) if getattr(cls, attr, None))
        assert older.get(model, FIXTURE_PLANS[model]) == have, (model, have)
