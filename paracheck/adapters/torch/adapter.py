"""The torch adapter's `Adapter` object (`domain.adapter`): what the kit asks of it, torch-free at import."""

from __future__ import annotations

from contextlib import contextmanager

from paracheck.adapters.torch import LIBRARY
from paracheck.domain.records import CheckId

COLUMNS = (CheckId.MESH, CheckId.TP_SHARDS, CheckId.FORWARD, CheckId.INFERENCE, CheckId.LOSS, CheckId.GRADS)


class TorchAdapter:
    name = LIBRARY
    dtypes = ("fp32",)
    columns = COLUMNS

    def parse_layout(self, name: str, order: str = "cp-fastest"):
        from paracheck.adapters.torch.layout import TorchLayout

        return TorchLayout.parse(name, order)

    def fixtures(self) -> dict[str, str]:
        """None bundled: a torch case is always the user's spec (examples/ holds worked ones)."""
        return {}

    def installed(self) -> bool:
        return True  # torch is the kit's own requirement

    def unsupported(self) -> str | None:
        return None

    def claims(self, factory) -> bool:
        from paracheck.adapters.torch.spec import claims

        return claims(factory)

    def variants(self) -> tuple[str, ...]:
        return ("base",)

    def expand(self, request) -> list:
        from paracheck.adapters.torch.cases import expand

        return expand(request)

    def case_options(self, case) -> list[str]:
        return []

    def training_parts(self, case) -> frozenset:
        """The default tier trains each spec (every spec is a plan of its own) on one layout per kind and per pair
        of kinds: a user's TP x FSDP plan reduces one gradient both ways, which neither tp4 nor fsdp4 shows."""
        from paracheck.domain.tier import composed_parts

        return frozenset(f"{case.factory}: {part}" for part in composed_parts(case.layout.name))

    def controls(self) -> dict:
        from paracheck.adapters.torch.controls import CONTROLS

        return CONTROLS

    def per_rank_refusal(self, name: str) -> str | None:
        from paracheck.adapters.torch.controls import per_rank_refusal

        return per_rank_refusal(name)

    @contextmanager
    def case_body(self, ctx):
        from paracheck.adapters.torch.body import TorchBody

        yield TorchBody(ctx)

    def preload(self) -> None:
        import torch.distributed.fsdp  # noqa: F401
        import torch.distributed.tensor.parallel  # noqa: F401

        from paracheck.adapters.torch import body  # noqa: F401

    def explore_target(self, factory: str, layouts_text: str, world: int, order: str = "cp-fastest") -> tuple:
        raise ValueError(f"--spec {factory!r}: explore does not draw torch specs yet (their inputs are the spec's "
                         "own); run them with paracheck run --spec")

    def explore_case(self, name, factory, space, layout, shape, dtype, extras=None):
        raise ValueError(f"--spec {factory!r}: explore does not draw torch specs yet")

    def mixins(self) -> dict[str, str]:
        return {"TorchParallelTesterMixin": "paracheck.adapters.torch.mixin:TorchParallelTesterMixin"}


ADAPTER = TorchAdapter()
