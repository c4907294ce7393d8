"""`parity.generate`'s single-process reference: a mode the library cannot run on one process is a note, never an
error of the case (deepseek_v4's StaticCache raises KeyError on its own layer type in transformers 5.25.0)."""

import pytest

transformers = pytest.importorskip("transformers")

from paracheck.adapters.transformers import fitting, generate  # noqa: E402


def test_a_mode_one_process_cannot_run_is_noted_and_the_others_are_held():
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV4Config

    torch.manual_seed(0)
    config = fitting.tiny(DeepseekV4Config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    batches = {mode: generate.prompts(1, config.vocab_size, padded) for mode, (_, padded) in generate.MODES.items()}
    found = generate._reference(model, batches)
    notes = {mode: held for mode, held in found.items() if isinstance(held, str)}
    assert set(found) == set(generate.MODES) and "dynamic" not in notes
    assert all(note.startswith(f"the single-process model does not generate in mode {mode}: ")
               for mode, note in notes.items())
    if transformers.__version__ == "5.25.0":  # the release where it was found; a later one may fix it
        assert set(notes) == {"static"} and "KeyError" in notes["static"]


def test_an_error_outside_the_library_is_raised_not_noted():
    """A KeyError of the kit's own (here: a batch it failed to make) must not pass for a mode one process cannot
    run: every layout would then go unchecked in that mode."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = fitting.tiny(LlamaConfig)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with pytest.raises(KeyError):
        generate._reference(model, {})
