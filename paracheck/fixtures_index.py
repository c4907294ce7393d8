"""Fixture names, importable without torch so the CLI can validate `--models` before any rank starts."""

FIXTURES: dict[str, str] = {
    "flux": "paracheck.fixtures:flux",
    "flux2": "paracheck.fixtures:flux2",
    "qwenimage": "paracheck.fixtures:qwenimage",
    "wan": "paracheck.fixtures:wan",
    "ltx": "paracheck.fixtures:ltx",
    "qwenimage21": "paracheck.fixtures:qwenimage21",
    "chronoedit": "paracheck.fixtures:chronoedit",
    "helios": "paracheck.fixtures:helios",
    "ltx2": "paracheck.fixtures:ltx2",
    "minimax_h3": "paracheck.fixtures:minimax_h3",
}

#: The diffusers classes the fixtures build (preloaded by the fork server).
FIXTURE_CLASSES = (
    "FluxTransformer2DModel", "Flux2Transformer2DModel", "QwenImageTransformer2DModel", "WanTransformer3DModel",
    "LTXVideoTransformer3DModel", "QwenImage21Transformer2DModel", "ChronoEditTransformer3DModel",
    "HeliosTransformer3DModel", "LTX2VideoTransformer3DModel", "MiniMaxH3Transformer3DModel",
)

#: Input variants (see docs/variants.md): one sample; two with different timesteps; one sample's text
#: padded and masked; lengths the CP degree does not divide (run with the library's "anything" modes).
VARIANTS = ("base", "batch2", "masked", "uneven")

#: The variants each fixture offers; a fixture absent here offers only "base".
FIXTURE_VARIANTS: dict[str, tuple[str, ...]] = {}
