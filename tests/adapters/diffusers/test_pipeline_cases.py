"""Which pipeline cases a run asks for (in process, no world): the default run's one case per pipeline, `--models
pipelines`, `--all`'s matrix with the caches and the sharded load, the controls and the variants they need."""

from __future__ import annotations

import functools

import pytest

from paracheck.adapters.diffusers.fixtures_index import (CACHE_VARIANTS, FIXTURE_PLANS, PIPELINE_DEFAULT_KIND,
                                                         PIPELINE_FIXTURES, PIPELINE_NOT_DEFAULT,
                                                         PIPELINE_TRANSFORMERS)
from paracheck.adapters.diffusers.pipelines.cases import is_pipeline_factory, one_kind
from paracheck.adapters.diffusers.pipelines.controls import PIPELINE_CONTROLS, planted_on
from paracheck.cli.common import UsageError
from paracheck.cli.main import build_cases, parser
from paracheck.domain.backends import resolve
from paracheck.domain.tier import layout_kind


@functools.lru_cache(maxsize=None)
def cases(*argv):
    """The cases `paracheck run ARGV` would launch (built once per argv: the default run's tier takes seconds)."""
    return tuple(build_cases(parser().parse_args(["run", *argv]), resolve("gloo")))


def pipelines(found):
    return [c for c in found if c.model in PIPELINE_FIXTURES]


def test_the_default_run_takes_one_case_per_pipeline_on_its_layout_kind():
    found = pipelines(cases())
    assert sorted(c.model for c in found) == sorted(set(PIPELINE_FIXTURES) - set(PIPELINE_NOT_DEFAULT))
    for case in found:
        assert layout_kind(case.layout.name) == PIPELINE_DEFAULT_KIND[case.model] and case.layout.world == 4
        assert case.variant == "base" and case.control is None
    # One CP and one TP layout between the pipelines whose transformer has both.
    both = [c for c in found if set(FIXTURE_PLANS[PIPELINE_TRANSFORMERS[c.model]]) == {"tp", "cp"}]
    assert {c.layout.has_tp for c in both} == {True, False}
    assert {c.route.value for c in found} == {"auto", "sharded-load"}


def test_models_pipelines_selects_every_pipeline_on_every_layout():
    found = cases("--models", "pipelines", "--nproc", "2")
    assert {c.model for c in found} == set(PIPELINE_FIXTURES)
    assert {c.layout.name for c in found} == {"tp2", "u2", "r2"}
    assert {c.variant for c in found} == {"base"}  # long and the caches are --all's or named
    with pytest.raises(UsageError, match="unknown"):
        cases("--models", "nope-pipeline")


def test_all_adds_long_the_caches_on_one_kind_layouts_and_the_sharded_load():
    found = pipelines(cases("--all"))
    assert {c.variant for c in found} == {"base", "long", *CACHE_VARIANTS}
    assert all(one_kind(c.layout) for c in found if c.variant in CACHE_VARIANTS)
    loaded = [c for c in found if c.route.value == "sharded-load"]
    assert loaded and all(c.layout.has_tp != c.layout.has_cp and c.variant == "base" for c in loaded)
    assert {c.model for c in loaded} == set(PIPELINE_FIXTURES)


def test_a_named_cache_variant_runs_without_all_on_the_layouts_named():
    found = cases("--models", "flux-pipeline", "--variants", "first-block-cache", "--layouts", "tp2xu2,u4")
    assert [(c.layout.name, c.variant) for c in found] == [("tp2xu2", "first-block-cache"), ("u4", "first-block-cache")]


def test_the_controls_go_to_the_pipeline_cases_with_the_variant_each_is_planted_on():
    found = cases("--models", "flux,flux-pipeline", "--layouts", "u2", "--nproc", "2", "--controls")
    model = {c.control for c in found if c.model == "flux" and c.control}
    piped = {(c.control, c.variant) for c in found if c.model == "flux-pipeline" and c.control}
    assert model and not model & set(PIPELINE_CONTROLS)
    assert piped == {(name, planted_on(name)) for name in PIPELINE_CONTROLS}
    # Each control's variant runs plain too, so the control can be judged against it.
    plain = {c.variant for c in found if c.model == "flux-pipeline" and c.control is None}
    assert plain == {"base", "first-block-cache"}


def test_the_quick_tier_keeps_each_pipelines_one_case():
    """The quick tier's pairwise cover starts from the matrix the adapter expanded: for the pipelines, one case each."""
    assert len(pipelines(cases())) == len(PIPELINE_FIXTURES) - len(PIPELINE_NOT_DEFAULT)


def test_a_pipeline_source_is_told_from_a_model_one():
    assert all(is_pipeline_factory(path) for path in PIPELINE_FIXTURES.values())
    assert is_pipeline_factory("tests.pytest.test_pipeline_mixin:FluxPipelineFastTestsConfig")
    assert not is_pipeline_factory("paracheck.fixtures:flux") and not is_pipeline_factory("payload")
