"""Whole diffusers pipelines under parallelism: the denoising loop of the parallel pipeline held, step by step, to the
same pipeline on one device (`parity.pipeline`).

A pipeline case is a fixture named `<model>-pipeline` (`fixtures/pipelines.py`), a `--spec` naming a class in
diffusers' pipeline-tester convention, or a `DiffusersPipelineParallelTesterMixin` test class. Modules, by role:
`spec` (what a pipeline case is built from), `cases` (its expansion, torch-free), `plan` (what every rank decides
first), `loop` (one run of a pipeline, recorded step by step), `reference` (the single-device run, shared through
the run directory), `caches` (diffusers' cache hooks by name), `controls` (the bugs planted where pipelines meet
parallelism), `agree` (the first-block cache's per-rank decision held to one answer across the CP ranks), `check`
(the check and its localization), `images` (what the report shows), `body` (the case's passes).
"""
