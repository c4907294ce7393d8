"""`CausalLMParallelTesterMixin` as a transformers contributor would use it: a tester's tiny config, one
launch for the class, one test per check and layout; and which layouts a config's plans allow."""

import pytest

transformers = pytest.importorskip("transformers")
pytest_plugins = ["pytester"]

from paracheck.adapters.transformers.mixin_cases import check_variants, plan_layouts  # noqa: E402
from paracheck.testing import CausalLMParallelTesterMixin  # noqa: E402


class TinyLlamaTester:
    """In the shape of transformers' model testers: `get_config()` returns the tiny config."""

    def get_config(self):
        return transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                        max_position_embeddings=32, tie_word_embeddings=False)


@pytest.mark.slow
class TestTinyLlamaParallel(TinyLlamaTester, CausalLMParallelTesterMixin):
    paracheck_layouts = ("tp2xfsdp2",)
    model_class = transformers.LlamaForCausalLM
    paracheck_steps, paracheck_checkpoint = 3, True  # the mixins' training, on a user's own tiny config
    paracheck_localize = False  # its controls' localization is test_localize_controls.py's


def test_a_dense_config_is_offered_every_layout_but_expert_parallel_ones():
    names = {layout.name for layout in plan_layouts(TinyLlamaTester().get_config(), 4)}
    assert {"tp4", "fsdp4", "dpr2xfsdp2", "tp2xfsdp2", "pp4"} <= names
    assert not any("ep" in name for name in names)


def test_a_config_without_a_tp_plan_is_offered_no_tensor_parallel_layout():
    config = TinyLlamaTester().get_config()
    config.base_model_tp_plan = {}
    names = {layout.name for layout in plan_layouts(config, 4)}
    assert names and not any("tp" in name for name in names)


def test_an_moe_config_is_offered_expert_parallel_layouts():
    config = transformers.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2)
    assert "tp2xfsdp2xep2" in {layout.name for layout in plan_layouts(config, 4)}


def test_a_variant_the_adapter_has_no_inputs_for_names_itself_and_the_choices():
    with pytest.raises(ValueError, match=r"paracheck_variants \['batch2'\]: a causal LM's variants are base, "):
        check_variants(("base", "batch2"))


def test_layouts_an_unadjusted_config_does_not_fit_are_skipped_with_the_rule_before_any_rank_starts(pytester):
    pytester.makepyfile(test_unadjusted='''
import transformers
from paracheck.testing import CausalLMParallelTesterMixin

class Tester:
    def get_config(self):
        return transformers.LlamaConfig(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)

class TestUnadjusted(Tester, CausalLMParallelTesterMixin):
    paracheck_layouts = ("tp4", "pp4")
''')
    result = pytester.runpytest_inprocess("-q", "-rs", "-p", "no:cacheprovider")
    text = result.stdout.str()
    assert "tp4: num_attention_heads=2 does not fit tp=4: tp must divide each head count" in text
    assert "pp4: num_hidden_layers=2 does not fit pp=4: every pipeline stage needs at least one layer" in text
    outcomes = result.parseoutcomes()
    assert outcomes.get("skipped", 0) >= 10 and not outcomes.get("failed") and not outcomes.get("error")
