"""What a negative control is: a planted bug, where it applies, and the checks that must catch it.

The kit's controls are in `controls.py`, the adapters' beside their adapter; both build this record, so it
sits below them (an adapter's controls never import the kit's registry, which looks them up).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from paracheck.domain.layout import Layout
from paracheck.domain.records import CaseStatus, CheckId, Route

#: In `Control.plants_in`: where only the case knows the place (a user's own module), the place its planter reported
#: (`RankResult.planted_in`).
PLANTED = "{planted}"

#: (model, applied, reference_state) -> None; runs after the route applied parallelism correctly.
Planter = Callable[[object, object, dict], None]


@dataclass(frozen=True)
class Control:
    name: str
    plants: str
    must_trip: tuple[CheckId, ...]
    #: Why `layout` cannot show this bug; None when it can.
    applies: Callable[[Layout], str | None]
    #: Bends one piece of a correctly parallelized model.
    planter: Planter | None = None
    #: Maps the mesh order the layout asks for to the one the route builds (planted while meshing).
    mesh_order: Callable[[str], str] | None = None
    #: Routes that can plant it; None for every route.
    routes: tuple[Route, ...] | None = None
    #: A note for the report, given the checks that failed.
    note: Callable[[set], str] | None = None
    #: A bug planted in the attention backend the case runs, diffusers' own or the kit's
    #: (one of `attention.FAULTS`).
    attention_fault: str | None = None
    #: Where the bug is planted, for a control that breaks the forward or the gradients: a glob over module
    #: names (forward) or parameter names (gradients) that the localization of a detected case must name
    #: (`checks.localize`); a glob where the name depends on the model ("*.attn*"); `{planted}` where only the
    #: case knows it (a user's own module): the place its planter reported (`RankResult.planted_in`). None: it
    #: breaks neither.
    plants_in: str | None = None
    #: Its planter is rank-dependent Python (it picks this rank's wrong shard by its rank): in a local world
    #: (`--local-world`) it runs once per rank, acting as that rank, not once for all of them.
    per_rank: bool = False

    @property
    def shows_in_training(self) -> bool:
        """Whether its bug shows in the optimizer steps or a save only (it must trip parity.steps or
        checkpoint.roundtrip): such a control runs where its case takes them (`domain.tier.with_training`)."""
        return bool({CheckId.STEPS, CheckId.CHECKPOINT} & set(self.must_trip))

    @property
    def shows_in_generate(self) -> bool:
        """Whether its bug shows in generation only (it must trip parity.generate): such a control runs where its
        case generates (`domain.tier.with_generate`)."""
        return CheckId.GENERATE in self.must_trip

    def planted_at(self, name: str | None, planted: str | None = None) -> bool:
        """Whether `name` (a module or parameter a localization named, or one call of it) is where this control plants:
        one of the `|`-separated globs of `plants_in` matches it, `{planted}` standing for `planted` (the
        place the case's planter reported; a glob with it matches nothing when there is none)."""
        from fnmatch import fnmatchcase

        if not self.plants_in or not name:
            return False
        name = name.split("#")[0]  # a module's k-th call (`name#k`, a later decode step) is that module
        globs = [g.replace(PLANTED, planted) if planted else g for g in self.plants_in.split("|")]
        return any(fnmatchcase(name, glob) for glob in globs if PLANTED not in glob)

    def skip_reason(self, layout: Layout, route: Route | None = None) -> str | None:
        """Why this control cannot run on `layout` (and `route`, once resolved); None when it can."""
        reason = self.applies(layout)
        route = Route(route) if route is not None else None
        if reason is None and route is not None and self.routes and route not in self.routes:
            reason = f"{self.name} is planted by the {'/'.join(r.value for r in self.routes)} route, not {route.value}"
        return reason

    def plant(self, model, applied, reference_state: dict) -> None:
        if self.planter is not None:
            self.planter(model, applied, reference_state)

    def order_for(self, order: str) -> str:
        return self.mesh_order(order) if self.mesh_order else order

    def judge(self, failing: set) -> tuple[CaseStatus, str]:
        """Detected when every check it must trip failed."""
        quiet = [c.value for c in self.must_trip if c not in failing]
        if quiet:
            return CaseStatus.MISSED, f"planted {self.name}; still passing: {', '.join(quiet)}"
        reason = f"planted {self.name}; tripped {', '.join(c.value for c in self.must_trip)}"
        extra = self.note(failing) if self.note else ""
        return CaseStatus.DETECTED, reason + (f" ({extra})" if extra else "")


def applicable_to(controls: dict, layout) -> list[str]:
    """The names of `controls` that can be planted on `layout` (by some route): the rule every adapter shares."""
    return [name for name, control in controls.items() if control.applies(layout) is None]
