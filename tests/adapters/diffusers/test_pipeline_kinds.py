"""The other kinds of pipeline on a planned transformer (`fixtures/pipeline_kinds.py`), in process, no world: each
builds its pipeline from tiny components, on the transformer class its name says, with the input its kind takes;
each runs under `--models pipelines` on every layout, and none joins the default run."""

from __future__ import annotations

import pytest

from paracheck.adapters.diffusers.fixtures_index import (FIXTURE_CLASSES, FIXTURES, PIPELINE_FIXTURES,
                                                         PIPELINE_KINDS, PIPELINE_NOT_BUNDLED, PIPELINE_NOT_DEFAULT,
                                                         PIPELINE_TRANSFORMERS)
from paracheck.adapters.diffusers.pipelines import spec
from paracheck.adapters.diffusers.pipelines.loop import pipeline_of
from paracheck.domain.case import load_object
from tests.adapters.diffusers.test_pipeline_cases import cases

#: What each kind is given beside the prompt, by the pipeline's own argument names.
KIND_INPUTS = {
    "flux-img2img-pipeline": {"image", "strength"}, "flux-inpaint-pipeline": {"image", "mask_image", "strength"},
    "flux-fill-pipeline": {"image", "mask_image"}, "flux-control-pipeline": {"control_image"},
    "flux-kontext-inpaint-pipeline": {"image", "image_reference", "mask_image", "strength"},
    "flux-controlnet-pipeline": {"control_image"}, "flux2-klein-pipeline": {"negative_prompt_embeds"},
    "flux2-klein-inpaint-pipeline": {"image", "mask_image", "strength"},
    "qwenimage-img2img-pipeline": {"image", "strength"}, "qwenimage-inpaint-pipeline": {"image", "mask_image"},
    "qwenimage-edit-pipeline": {"image"}, "wan-i2v-pipeline": {"image"}, "wan-v2v-pipeline": {"video", "strength"},
    "lucy-edit-pipeline": {"video"}, "ltx-i2v-pipeline": {"image"}, "ltx-condition-pipeline": {"image", "frame_index"},
    "ltx2-i2v-pipeline": {"image"}, "flux-control-img2img-pipeline": {"image", "control_image", "strength"},
    "flux-control-inpaint-pipeline": {"image", "control_image", "mask_image"},
    "flux-controlnet-img2img-pipeline": {"image", "control_image", "strength"},
    "flux-controlnet-inpaint-pipeline": {"image", "control_image", "mask_image"},
    "qwenimage-controlnet-pipeline": {"control_image"}, "flux2-klein-kv-pipeline": {"image"},
    "qwenimage-edit-plus-pipeline": {"image"}, "ltx2-condition-pipeline": {"conditions"},
    "helios-pyramid-pipeline": {"pyramid_num_inference_steps_list"},
    "qwenimage-controlnet-inpaint-pipeline": {"control_image", "control_mask"},
    "ltx2-in-context-pipeline": {"reference_conditions"}, "ltx2-hdr-pipeline": {"reference_conditions"},
    "ltx2-dfr-pipeline": {"sigmas"}, "qwenimage-layered-pipeline": {"image", "layers", "resolution", "prompt"},
    "ltx2-dfr-temporal-refine-pipeline": {"latents", "keyframes_latents", "keyframe_positions", "audio_latents",
                                          "sigmas"},
}


def test_every_kind_is_bundled_named_and_left_out_of_the_default_run():
    assert set(KIND_INPUTS) == set(PIPELINE_KINDS) <= set(PIPELINE_FIXTURES) & set(PIPELINE_NOT_DEFAULT)
    # The default run takes PIPELINE_FIXTURES less PIPELINE_NOT_DEFAULT (test_pipeline_cases holds it to that).
    assert all(PIPELINE_TRANSFORMERS[name] == model for name, (model, _) in PIPELINE_KINDS.items())


@pytest.mark.parametrize("name", sorted(PIPELINE_KINDS))
def test_each_kind_builds_its_pipeline_on_its_transformer_with_its_input(name):
    source = spec.from_tester(load_object(PIPELINE_FIXTURES[name]), name)
    pipe = pipeline_of(source, source.components())
    transformer_class = dict(zip(FIXTURES, FIXTURE_CLASSES))[PIPELINE_TRANSFORMERS[name]]
    assert type(pipe).__name__ == source.pipeline_class.__name__ == PIPELINE_KINDS[name][1] + "Pipeline"
    assert type(pipe.transformer).__name__ == transformer_class
    inputs = source.inputs(0)
    assert KIND_INPUTS[name] <= set(inputs) and "prompt_embeds" in inputs
    assert "prompt" not in inputs or "prompt" in KIND_INPUTS[name]  # Layered's, or it captions with Qwen2.5-VL
    assert source.default_steps() >= 3


def test_models_pipelines_takes_each_kind_on_the_layouts_of_its_text_pipeline():
    """A kind shares its transformer's plans with its text pipeline, so the two expand to the same layouts."""
    found = cases("--models", ",".join(PIPELINE_KINDS) + ",flux-pipeline,wan-pipeline", "--nproc", "2")
    layouts = {}
    for case in found:
        layouts.setdefault(case.model, set()).add(case.layout.name)
    assert set(layouts) == set(PIPELINE_KINDS) | {"flux-pipeline", "wan-pipeline"}
    assert all(layouts[name] == {"tp2", "u2", "r2"} for name in layouts)
    assert {c.variant for c in found} == {"base"}


def test_a_controlnet_takes_the_heads_fitting_gave_its_transformer():
    """Its residuals are added to the transformer's hidden states: fitted to 4 heads (tp2 on a 3-head transformer),
    the ControlNet must have 4 too, or the pipeline fails on one device (64 against 48)."""
    from paracheck.adapters.diffusers.pipelines.plan import _heads_followed

    controlnet = load_object(PIPELINE_FIXTURES["qwenimage-controlnet-pipeline"])().get_dummy_components()["controlnet"]
    followed = _heads_followed(controlnet, {"num_attention_heads": 4})
    assert followed.config.num_attention_heads == 4 and controlnet.config.num_attention_heads == 3
    assert followed.config.attention_head_dim == controlnet.config.attention_head_dim
    assert _heads_followed(controlnet, {"num_kv_heads": 2}) is controlnet


def test_a_pipeline_that_counts_its_steps_per_stage_has_a_variants_steps_spread_over_them():
    """Helios Pyramid takes no `num_inference_steps`: its steps are a count per stage, which the kit spreads a
    variant's steps over (the earlier stages taking the remainder); the other pipelines take the count as it is."""
    from paracheck.domain.case import SpecError

    pyramid = spec.from_tester(load_object(PIPELINE_FIXTURES["helios-pyramid-pipeline"]))
    assert pyramid.default_steps() == 3 and "num_inference_steps" not in pyramid.inputs()
    assert pyramid.step_inputs(3) == {"pyramid_num_inference_steps_list": [2, 1]}
    assert pyramid.step_inputs(8) == {"pyramid_num_inference_steps_list": [4, 4]}
    with pytest.raises(SpecError, match="1 steps cannot be spread over 2 stages"):
        pyramid.step_inputs(1)
    flux = spec.from_tester(load_object(PIPELINE_FIXTURES["flux-pipeline"]))
    assert flux.default_steps() == 3 and flux.step_inputs(6) == {"num_inference_steps": 6}


def test_faster_cache_reads_the_loops_first_timestep_as_the_schedules_top():
    """An img2img pipeline at strength 0.75 starts near timestep 800, inside FasterCache's skip range (-1, 901): its
    first step would skip into an empty cache (a TypeError on one device, QwenImage img2img's before). The first
    step's calls (both guidance branches) read 1000 (computed); once the timestep moved, every call reads its own
    value, a later one equal to the first too (a second stage from the top: the kit forces the loop's first step
    only); a pipeline that keeps none still reads None."""
    from types import SimpleNamespace

    from paracheck.adapters.diffusers.pipelines.caches import _first_at_top

    pipe = SimpleNamespace(current_timestep=None)
    current = _first_at_top(pipe)
    assert current() is None
    read = []
    for t in (750.0, 750.0, 500.0, 750.0, 250.0):
        pipe.current_timestep = t
        read.append(current())
    assert read == [1000, 1000, 500.0, 750.0, 250.0]
    assert not -1 < read[0] < 901 and all(-1 < t < 901 for t in read[2:])


def _bundled_classes() -> set:
    return {path.rpartition(":")[2].removesuffix("Case") for path in PIPELINE_FIXTURES.values()}


def test_every_pipeline_on_a_planned_transformer_is_bundled_or_its_blocker_named():
    """diffusers 0.42.1's 46 (`test_the_installed_release_has_no_other` reads them from the release): each either a
    fixture or a named blocker, never both."""
    assert len(_bundled_classes()) == len(PIPELINE_FIXTURES) == 42 and len(PIPELINE_NOT_BUNDLED) == 4
    assert not _bundled_classes() & set(PIPELINE_NOT_BUNDLED)
    assert all(len(reason) > 40 for reason in PIPELINE_NOT_BUNDLED.values())


def test_the_installed_release_has_no_other_pipeline_on_a_planned_transformer():
    """Every pipeline class in diffusers' pipeline modules whose `transformer` argument is annotated with a
    transformer class that has a plan (the model fixtures' classes): read from the source with `ast` (importing every
    pipeline takes 37 s here), in the files that name one of those classes."""
    import ast
    import pathlib

    import diffusers

    planned_transformers = set(FIXTURE_CLASSES)
    planned = set()
    for path in pathlib.Path(diffusers.__file__).parent.joinpath("pipelines").rglob("pipeline_*.py"):
        source = path.read_text()
        if not any(name in source for name in planned_transformers):  # parsing all 13 MB takes 17 s
            continue
        for node in ast.walk(ast.parse(source)):
            init = isinstance(node, ast.ClassDef) and next(
                (f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
            arg = init and next((a for a in init.args.args if a.arg == "transformer" and a.annotation), None)
            if arg and planned_transformers & {n.id for n in ast.walk(arg.annotation) if isinstance(n, ast.Name)}:
                planned.add(node.name)
    assert planned == _bundled_classes() | set(PIPELINE_NOT_BUNDLED)


def test_a_cache_diffusers_keeps_off_on_one_device_is_named_not_compared():
    """SeaCache needs the step, sigma and step count in each `cache_context`; Flux's pipeline gives none, so diffusers
    runs it fail-open (every call in full) and a parallel case would compare two uncached runs. Wan's text pipeline
    gives them: the same check passes there (the negative control), and still passes once one call has fallen back
    (a call outside any context: diffusers' fail-open warning for that call alone) where the others reused."""
    import torch

    from paracheck.adapters.diffusers.pipelines import caches, loop

    for name, off in (("flux-pipeline", True), ("wan-pipeline", False)):
        source = spec.from_tester(load_object(PIPELINE_FIXTURES[name]), name)
        pipe = pipeline_of(source, source.components())
        caches.enable(pipe, "sea-cache", 4, source.guidance, {})
        rec = loop.run(pipe, dict(source.inputs(0), **source.step_inputs(4)), record_calls=True)
        calls, reused = pipe.transformer._sea_reuses
        if off:
            assert calls == len(rec.calls) and reused == 0
            said = "FluxPipeline runs sea-cache off on one device .it reused on none of 8 calls.: .*fail-open"
            with pytest.raises(caches.Inert, match=said):
                caches.inert(pipe, "sea-cache")
            continue
        assert 0 < reused < calls == len(rec.calls)
        caches.inert(pipe, "sea-cache")
        _, args, kwargs, _ = rec.calls[-1]
        with torch.no_grad():
            pipe.transformer(*args, **kwargs)  # outside any cache context: runs full, warns once
        warned = pipe.transformer._diffusers_hook.get_hook("sea_cache_root").shared_state._warned_messages
        assert any("fail-open" in m for m in warned)
        caches.inert(pipe, "sea-cache")
