"""The other kinds of pipeline on a planned transformer (`fixtures/pipeline_kinds.py`), in process, no world: each
builds its pipeline from tiny components, on the transformer class its name says, with the input its kind takes;
each runs under `--models pipelines` on every layout, and none joins the default run."""

from __future__ import annotations

import pytest

from paracheck.adapters.diffusers.fixtures_index import (FIXTURE_CLASSES, FIXTURES, PIPELINE_FIXTURES,
                                                         PIPELINE_KINDS, PIPELINE_NOT_DEFAULT, PIPELINE_TRANSFORMERS)
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
    assert KIND_INPUTS[name] <= set(inputs) and "prompt_embeds" in inputs and "prompt" not in inputs
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
