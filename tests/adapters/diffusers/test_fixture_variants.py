"""Every fixture's input variants on one device: they build, run forward and backward, and have the property
their name promises. The fixtures are loaded from this checkout by path (the installed `paracheck.fixtures`
may map elsewhere)."""

from __future__ import annotations

import functools
import importlib.util
import inspect
from pathlib import Path

import pytest
import torch

from paracheck.adapters.diffusers.fixtures_index import FIXTURE_VARIANTS, FIXTURES, VARIANTS


def _load_fixtures():
    spec = importlib.util.spec_from_file_location("_fixtures_here", Path(__file__).parents[3] / "fixtures/__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fx = _load_fixtures()
CASES = [(name, variant) for name, variants in FIXTURE_VARIANTS.items() for variant in variants]
#: Fixtures whose output 0 is the joint text + image sequence (text first), not the shape of `hidden_states`.
JOINT_OUTPUT = {"qwenimage21"}


def _copy(inputs: dict) -> dict:
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in inputs.items()}


@functools.cache
def _model(name: str):
    model_class, init, _ = getattr(fx, name)()
    torch.manual_seed(0)
    return model_class(**init)


def build(name: str, variant: str):
    """The fixture's model (built once: every variant has the same class and init dict) and the variant's inputs."""
    model = _model(name)
    model.zero_grad(set_to_none=True)
    return model, getattr(fx, name)(variant)[2]


def outputs(model, inputs: dict) -> list[torch.Tensor]:
    out = model(**_copy(inputs), return_dict=False)
    return [o for o in out if torch.is_tensor(o) and o.is_floating_point()]


def cp_split_lengths(model, inputs: dict) -> dict[str, int]:
    """The length of every tensor the model's `_cp_plan` splits, measured on a forward: "module:input" -> size.
    Entries whose rank differs from `expected_dims` are left out, as diffusers leaves them unsplit."""
    lengths: dict[str, int] = {}
    handles = []
    for path, entries in (type(model)._cp_plan or {}).items():
        if not isinstance(entries, dict):
            continue  # a ContextParallelOutput: a gather, not a split
        module = model.get_submodule(path.replace("*", "0"))

        def record(where, key, spec, value):
            if torch.is_tensor(value) and value.dim() == spec.expected_dims:
                lengths[f"{where}:{key}"] = value.shape[spec.split_dim]

        def pre(mod, args, kwargs, path=path, entries=entries):
            bound = inspect.signature(mod.forward).bind_partial(*args, **kwargs).arguments
            for key, spec in entries.items():
                if isinstance(key, str) and not spec.split_output:
                    record(path, key, spec, bound.get(key))

        def post(mod, args, kwargs, out, path=path, entries=entries):
            for key, spec in entries.items():
                if isinstance(key, int) and spec.split_output:
                    record(path, key, spec, out[key])

        handles += [module.register_forward_pre_hook(pre, with_kwargs=True),
                    module.register_forward_hook(post, with_kwargs=True)]
    try:
        with torch.no_grad():
            outputs(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
    return lengths


@pytest.mark.parametrize("name,variant", CASES, ids=[f"{n}-{v}" for n, v in CASES])
def test_variant_runs(name, variant):
    model, inputs = build(name, variant)
    batch = 2 if variant in ("batch2", "masked") else 1
    outs = outputs(model, inputs)
    assert all(torch.isfinite(o).all() for o in outs)
    hidden = inputs["hidden_states"]
    assert outs[0].shape[0] == batch == hidden.shape[0]
    if name not in JOINT_OUTPUT:
        assert outs[0].shape == hidden.shape
    sum(o.pow(2).mean() for o in outs).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)
    if batch == 2:
        assert not torch.allclose(outs[0][0], outs[0][1], atol=1e-4)
    if variant == "uneven":
        lengths = cp_split_lengths(model, inputs)
        assert lengths and all(n % 2 for n in lengths.values()), lengths


@pytest.mark.parametrize("name", list(FIXTURES))
def test_base_is_the_default(name):
    class_a, init_a, a = getattr(fx, name)()
    class_b, init_b, b = getattr(fx, name)("base")
    assert class_a is class_b and init_a == init_b and a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]) if torch.is_tensor(a[key]) else a[key] == b[key], key


@pytest.mark.parametrize("name", list(FIXTURES))
def test_variants_share_the_model(name):
    base = getattr(fx, name)()[:2]
    assert all(getattr(fx, name)(variant)[:2] == base for variant in FIXTURE_VARIANTS[name])


def test_batch2_timesteps_differ():
    for name, variants in FIXTURE_VARIANTS.items():
        if name != "minimax_h3":  # its timestep is a per-row table shared by the batch
            timestep = getattr(fx, name)("batch2")[2]["timestep"]
            assert timestep.shape == (2,) and timestep[0] != timestep[1], name


def _sample1_rows(name, outs, inputs):
    """Sample 1's output rows that no padded position owns (QwenImage21 outputs its text rows too)."""
    if name in JOINT_OUTPUT:
        valid = inputs["encoder_hidden_states_mask"][1].bool()
        outs = [torch.cat([o[1, : len(valid)][valid], o[1, len(valid):]]) for o in outs]
        return torch.cat([o.flatten() for o in outs])
    return torch.cat([o[1].flatten() for o in outs])


@pytest.mark.parametrize("name", [n for n, v in FIXTURE_VARIANTS.items() if "masked" in v])
def test_masked_mask_matters(name):
    model, inputs = build(name, "masked")
    for text_key, mask_key in fx.TEXT_MASKS[name]:
        mask = inputs[mask_key]
        assert mask[0].all() and 0 < (mask[1] == 0).sum() <= mask.shape[1] // 2
        assert (mask[1, -1] == 0) and mask[1, 0] == 1
    other = fx.fill_padding(_copy(inputs), name, seed=2)
    unmasked = {k: v for k, v in inputs.items()}
    for _, mask_key in fx.TEXT_MASKS[name]:
        unmasked[mask_key] = torch.ones_like(inputs[mask_key])
    other_unmasked = dict(other, **{k: unmasked[k] for _, k in fx.TEXT_MASKS[name]})
    with torch.no_grad():
        masked = [_sample1_rows(name, outputs(model, x), inputs) for x in (inputs, other)]
        plain = [_sample1_rows(name, outputs(model, x), inputs) for x in (unmasked, other_unmasked)]
    assert (masked[0] - masked[1]).abs().max() < 1e-6
    assert (plain[0] - plain[1]).abs().max() > 1e-3


@pytest.mark.parametrize("name", list(FIXTURES))
def test_unknown_variant_names_the_choices(name):
    with pytest.raises(ValueError) as error:
        getattr(fx, name)("nope")
    message = str(error.value)
    assert name in message and "nope" in message
    assert all(variant in message for variant in FIXTURE_VARIANTS[name])


def test_table_names_known_variants():
    assert set(FIXTURE_VARIANTS) == set(FIXTURES)
    for name, variants in FIXTURE_VARIANTS.items():
        assert variants[0] == "base" and set(variants) <= set(VARIANTS)
        assert ("masked" in variants) == (name in fx.TEXT_MASKS)
