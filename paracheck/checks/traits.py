"""What a case's inputs carry that known-failure entries may require (`results.known.INPUT_TRAITS`), found the
same way for every library's inputs."""

from __future__ import annotations

import torch


def input_traits(inputs: dict) -> list[str]:
    """"mask" when an attention-mask input is given, "padded" when it also masks something out: what an
    upstream bug that lives in mask handling needs, whatever the variant or test class is called."""
    masks = [v for k, v in inputs.items() if "mask" in k and isinstance(v, torch.Tensor)]
    traits = ["mask"] if masks else []
    if any(bool((m == 0).any()) for m in masks):
        traits.append("padded")
    return traits
