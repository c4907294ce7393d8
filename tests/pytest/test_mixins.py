"""The pytest mixins as a diffusers contributor would use them. Head counts (3) divide no tp x ulysses,
so every class exercises the fitting."""

import textwrap

import pytest
import torch
from diffusers import FluxTransformer2DModel, QwenImageTransformer2DModel, WanTransformer3DModel

from paracheck.testing import ContextParallelTesterMixin, HybridParallelTesterMixin, TensorParallelTesterMixin

pytest_plugins = ["pytester"]

# Every class here and both pytester runs launch gloo worlds of ranks.
pytestmark = pytest.mark.slow


class FluxTransformerTesterConfig:
    """In the shape of diffusers' own tester configs: `model_class` and `generator` are properties, and
    inputs come from `get_dummy_inputs(batch_size, device)` through a seeded generator."""

    @property
    def model_class(self):
        return FluxTransformer2DModel

    @property
    def generator(self):
        return torch.Generator("cpu").manual_seed(0)

    def get_init_dict(self):
        return {"patch_size": 1, "in_channels": 4, "num_layers": 1, "num_single_layers": 1,
                "attention_head_dim": 16, "num_attention_heads": 3, "joint_attention_dim": 32,
                "pooled_projection_dim": 32, "axes_dims_rope": (4, 4, 8)}

    def get_dummy_inputs(self, batch_size=1, device="cpu"):
        g = self.generator
        return {"hidden_states": torch.randn(batch_size, 16, 4, generator=g).to(device),
                "encoder_hidden_states": torch.randn(batch_size, 8, 32, generator=g).to(device),
                "pooled_projections": torch.randn(batch_size, 32, generator=g).to(device),
                "timestep": torch.linspace(0.3, 1.0, batch_size).to(device),
                "img_ids": torch.randn(16, 3, generator=g).to(device),
                "txt_ids": torch.randn(8, 3, generator=g).to(device)}


class QwenImageTransformerTesterConfig:
    model_class = QwenImageTransformer2DModel

    def get_init_dict(self):
        return {"patch_size": 2, "in_channels": 16, "out_channels": 4, "num_layers": 2, "attention_head_dim": 16,
                "num_attention_heads": 3, "joint_attention_dim": 16, "axes_dims_rope": (8, 4, 4)}

    def get_dummy_inputs(self, batch_size=1):
        g = torch.Generator().manual_seed(0)
        return {"hidden_states": torch.randn(batch_size, 16, 16, generator=g),
                "encoder_hidden_states": torch.randn(batch_size, 8, 16, generator=g),
                "encoder_hidden_states_mask": torch.ones(batch_size, 8, dtype=torch.long),
                "timestep": torch.tensor([1.0]).expand(batch_size),
                "img_shapes": [(1, 4, 4)] * batch_size}  # a list of tuples must survive the trip


class WanTransformerTesterConfig:
    model_class = WanTransformer3DModel

    def get_init_dict(self):
        return {"patch_size": (1, 2, 2), "num_attention_heads": 3, "attention_head_dim": 12, "in_channels": 4,
                "out_channels": 4, "text_dim": 32, "freq_dim": 32, "ffn_dim": 32, "num_layers": 1,
                "rope_max_seq_len": 32}

    def get_dummy_inputs(self):
        g = torch.Generator().manual_seed(0)
        return {"hidden_states": torch.randn(1, 4, 2, 8, 8, generator=g), "timestep": torch.tensor([[500] * 32]),
                "encoder_hidden_states": torch.randn(1, 8, 32, generator=g)}


class TestFluxHybrid(FluxTransformerTesterConfig, HybridParallelTesterMixin):
    paracheck_variants = ("base", "batch2")
    paracheck_localize = False  # its controls are localized by test_localize_controls.py; here half its time


class TestQwenImageHybrid(QwenImageTransformerTesterConfig, HybridParallelTesterMixin):
    paracheck_localize = False


def test_a_class_that_asks_for_no_localization_reruns_no_failing_case():
    """`paracheck_localize = False`: every detected control keeps its gradient table, and none was rerun."""
    from paracheck.domain.backends import get_backend
    from paracheck.pytest.mixin import _results

    found = _results(TestFluxHybrid(), get_backend("gloo"), 4)
    controls = [(v, ranks) for (_, _, control), (v, ranks) in found.items() if control and v.status.value == "detected"]
    assert controls
    for verdict, ranks in controls:
        for rank in ranks:
            held = [c.data.get("localization", {}) for c in rank.checks if c.status.value == "fail"]
            assert not any("forward" in h or "backward" in h.get("grads", {}) for h in held), verdict.case.id


class TestFluxTensorParallel(FluxTransformerTesterConfig, TensorParallelTesterMixin):
    paracheck_controls = False


class TestWanContextParallel(WanTransformerTesterConfig, ContextParallelTesterMixin):
    paracheck_layouts = ("u2", "r2")


def test_failing_mixin_shows_ranks_and_replay(pytester):
    """A test file outside any package, two classes run with -n 2: one passes, one hits the upstream
    Ulysses-backward bug and its failure shows the per-rank table and the replay command."""
    pytester.makepyfile(test_outside=textwrap.dedent('''
        import torch
        from diffusers import LTXVideoTransformer3DModel
        from paracheck.testing import ContextParallelTesterMixin

        class LtxConfig:
            model_class = LTXVideoTransformer3DModel
            paracheck_layouts = ("u2",)
            paracheck_controls = False

            def get_init_dict(self):
                return dict(in_channels=8, out_channels=8, num_attention_heads=3, attention_head_dim=12,
                            cross_attention_dim=36, num_layers=1, caption_channels=32)

            def get_dummy_inputs(self, batch_size=1):
                g = torch.Generator().manual_seed(0)
                return dict(hidden_states=torch.randn(1, 16, 8, generator=g),
                            encoder_hidden_states=torch.randn(1, self.text_tokens, 32, generator=g),
                            timestep=torch.tensor([500]), encoder_attention_mask=None,
                            num_frames=1, height=4, width=4)

        class TestLtxShortText(LtxConfig, ContextParallelTesterMixin):
            text_tokens = 8
            paracheck_known_failures = "none"  # the shipped file declares this bug

        class TestLtxEqualText(LtxConfig, ContextParallelTesterMixin):
            text_tokens = 16
    '''))
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider", "-rA", timeout=600)
    out = result.stdout.str()
    # skipped: no control for paracheck_controls=False (2), no training by default (2)
    result.assert_outcomes(passed=7, failed=1, skipped=4)
    assert "FAILED test_outside.py::TestLtxShortText::test_paracheck_grads[u2]" in out
    assert "rank  mesh" in out and "backward raised RuntimeError" in out
    assert "replay: pytest 'test_outside.py::TestLtxShortText::test_paracheck_grads[u2]'" in out


def test_diffusers_own_ltx_tester_configs_meet_the_declared_bugs(pytester):
    """LTX and LTX2 tester configs in diffusers' own shape and values (batch 2, a text mask of ones in the
    base inputs, LTX2's audio and video together): the upstream bugs they hit are declared by what fails
    (model class, layout kind, check, what the inputs carry), so a user's inputs get the same xfail as the
    fixtures' `masked` variant, with the reason."""
    pytester.makepyfile(test_ltx_configs=textwrap.dedent('''
        import torch
        from diffusers import LTX2VideoTransformer3DModel, LTXVideoTransformer3DModel
        from paracheck.testing import ContextParallelTesterMixin

        def noise(*shape, g):
            return torch.randn(*shape, generator=g)

        class LtxConfig:
            model_class = LTXVideoTransformer3DModel

            def get_init_dict(self):
                return dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
                            cross_attention_dim=16, num_layers=1, qk_norm="rms_norm_across_heads",
                            caption_channels=16)

            def get_dummy_inputs(self):
                g = torch.Generator().manual_seed(0)
                return dict(hidden_states=noise(2, 2 * 16 * 16, 4, g=g), encoder_hidden_states=noise(2, 16, 16, g=g),
                            timestep=torch.randint(0, 1000, (2,), generator=g),
                            encoder_attention_mask=torch.ones(2, 16).bool(), num_frames=2, height=16, width=16)

        class Ltx2Config:
            model_class = LTX2VideoTransformer3DModel

            def get_init_dict(self):
                return dict(in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2,
                            attention_head_dim=8, cross_attention_dim=16, audio_in_channels=4,
                            audio_out_channels=4, audio_num_attention_heads=2, audio_attention_head_dim=4,
                            audio_cross_attention_dim=8, num_layers=2, qk_norm="rms_norm_across_heads",
                            caption_channels=16, rope_double_precision=False)

            def get_dummy_inputs(self):
                g = torch.Generator().manual_seed(0)
                return dict(hidden_states=noise(2, 2 * 16 * 16, 4, g=g), audio_hidden_states=noise(2, 9, 4, g=g),
                            encoder_hidden_states=noise(2, 16, 16, g=g),
                            audio_encoder_hidden_states=noise(2, 16, 16, g=g),
                            timestep=noise(2, g=g).abs() * 1000, encoder_attention_mask=torch.ones(2, 16).bool(),
                            num_frames=2, height=16, width=16, audio_num_frames=9, fps=25.0)

        class TestLtx(LtxConfig, ContextParallelTesterMixin):
            paracheck_layouts = ("u2",)
            paracheck_controls = False

        class TestLtx2(Ltx2Config, ContextParallelTesterMixin):
            paracheck_layouts = ("u2", "r2")
            paracheck_controls = False
    '''))
    # In this process: the class's launch forks its ranks from the session's preloaded fork server.
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-rA")
    out = result.stdout.str()
    for test in ("TestLtx::test_paracheck_forward[u2]", "TestLtx2::test_paracheck_forward[u2]",
                 "TestLtx2::test_paracheck_forward[r2]", "TestLtx2::test_paracheck_inference[r2]"):
        assert f"XFAIL test_ltx_configs.py::{test}" in out, out
    assert "global head count" in out and "cross_attn_rope" in out and "even for a mask of ones" in out
    assert "FAILED" not in out
