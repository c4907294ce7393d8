"""The `Adapter` protocol: what a library's adapter gives the kit, and the one case body its ranks run.

A library plugs in by implementing `Adapter` in its own package and naming the object in the entry-point group
`paracheck.adapters` (`paracheck.registry` finds it; the host never names an adapter). Every method the launcher
side calls is torch-free at import; the rank side (`case_body`) may import the library.

What an adapter and a case body may provide is declared at the end of this module (`ADAPTER`, `CASE_BODY`, in
`domain.contract`'s terms): the protocols' members, required, and the optional ones with the host's defaults. The
registry refuses an adapter that breaks them when it loads; the skeleton binds each case body the same way.

One case on one rank is run by the kit's skeleton (`rank.skeleton.run_case`), never by an adapter: the skeleton
builds the `RankResult`, the tolerance (from the case's dtype and the rank's device, with the case's own
overrides), times each phase, types a raise, blames a lost peer, and frees the world's unused groups. The
adapter's `CaseBody` supplies the passes, in this order:

    reference()  -> the single-device run (computed, shared or kept; raise `Refused` to stop the case)
    parallelize() -> the parallel model (the library's own parallel API, or the user's function)
    structure_checks() -> the structure checks on it
    inference()  -> the forward under torch.no_grad()
    training()   -> the forward with gradients recorded
    forward_checks() -> outputs, losses, collectives against the reference
    backward()   -> the backward of the training forward (not called when grads are off or nothing to derive)
    grads_checks() -> every gradient against the reference
    localize(checks) -> optional: where a parity check failed on any rank, rerun that pass with hooks and attach
                        the localization to the failing checks (every rank takes part; they decide alike)
    generate()   -> optional, where `case.generate`: `parity.generate`, greedy generation on the parallel model
                    against the single-device model's (the model is left as it was)
    steps()      -> optional, where `case.steps` > 0: `parity.steps`, that many optimizer steps on the parallel
                    model and on a fresh reference, through the library's own trainer where it has one
    checkpoint() -> optional, where `case.checkpoint`: `checkpoint.roundtrip`, saves and loads of the
                    parallel model (each in a directory of its own under the case's workdir, removed after)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Protocol, runtime_checkable

from paracheck.domain.contract import Member, Spec, declared, optional
from paracheck.domain.records import CheckId, CheckResult, Failure, RankStatus, Status


class Refused(Exception):
    """The case stops before its passes, for a reason decided alike on every rank (the library refuses, the
    control cannot apply, the layout does not fit): a skip in these words (or `status`, e.g. an error the single-
    device reference raised). `failure` types it where a found case must replay it."""

    def __init__(self, reason: str, failure: Failure | None = None, status: RankStatus = RankStatus.SKIP):
        super().__init__(reason)
        self.failure, self.status = failure, status


@dataclass
class CaseRequest:
    """What `paracheck run` (or a mixin) asks an adapter to expand into cases: its models, and the run's options.

    `models`: (name, factory path) pairs this adapter claimed. `layouts`: the `--layouts` text ("all" or names),
    read by the adapter's grammar. `variants`: names, or None for the adapter's default tier."""
    models: list[tuple[str, str]]
    layouts: str = "all"
    nproc: int = 4
    order: str = "cp-fastest"
    variants: list[str] | None = None
    controls: bool = False
    only_control: str | None = None
    grads: bool = True
    dtype: str = "fp32"
    route: str = "auto"
    #: The `--cp-options` text (the adapter whose options they are parses it).
    cp_options: str = ""
    attention_backend: str = "auto"
    #: True when the factories came from --spec (the user's own), not the bundled fixtures.
    spec: bool = False
    #: True when the user named the models (by --models or --spec): a layout none of them takes is then an error.
    named: bool = False
    #: --all: the whole matrix, not the default tier.
    everything: bool = False


@dataclass
class SweepRequest:
    """`--models LIBRARY:NAMES`: an adapter's sweep over its library's own families. `names`: "all" or a comma
    list; the rest as `CaseRequest`'s, with --shard I/N and --resume REPORT.json (the sweep plans only what they
    leave, so it builds only the families that needs)."""
    names: str
    layouts: str = "all"
    nproc: int = 4
    controls: bool = False
    only_control: str | None = None
    everything: bool = False
    shard: str | None = None
    resume: str | None = None
    #: parity.steps' optimizer steps (0: none) and checkpoint.roundtrip, turned on per family as the default tier
    #: turns them on (`domain.tier.with_training`): one layout of each kind, every one with `everything`.
    steps: int = 0
    checkpoint: bool = False


@dataclass(frozen=True)
class TopologyRequest:
    """`paracheck topology --simulate`, as the host parsed it: what an adapter's simulation is asked (the flags are
    the contract's; the host refuses the simulate-only ones without --simulate)."""
    backend: str
    world: int
    heads: int | None = None
    layout: str | None = None
    order: str = "cp-fastest"
    models: str | None = None
    spec: tuple = ()
    route: str | None = None
    control: str | None = None
    collectives: bool = False
    report_json: str | None = None


@dataclass
class Swept:
    """A sweep ready for the host's one launch: every case in order; those decided before any rank starts (index
    -> the `RankResult`s that decide it: a named skip, or the error its family's build raised); what the report's
    meta adds; the counts line's tail; `close()` removes what the sweep built, once the run is over; a resumed
    report's entries for the cases it left out (`--resume`), carried into the run's report."""
    cases: list
    decided: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    tail: str = ""
    close: Callable[[], None] = lambda: None
    carried: list = field(default_factory=list)


@runtime_checkable
class CaseBody(Protocol):
    """One case's passes on one rank (see the module docstring for the order the skeleton calls them in)."""

    def reference(self) -> None: ...

    def parallelize(self) -> None: ...

    def structure_checks(self) -> list[CheckResult]: ...

    def inference(self) -> None: ...

    def training(self) -> None: ...

    def forward_checks(self) -> list[CheckResult]: ...

    #: Why no backward runs (no loss, --no-grads, the forward raised); None when it does.
    def backward_skip(self) -> str | None: ...

    def backward(self) -> None: ...

    def grads_checks(self) -> list[CheckResult]: ...


@dataclass
class Tolerance:
    atol: float
    rtol: float


@dataclass
class CaseContext:
    """What the skeleton hands an adapter's `case_body`: the case, where it runs, and the rules it is held to."""
    case: Any
    backend: Any
    site: Any
    #: The `RankResult` being filled (adapters set `route`, `fit`, `model_class`, `inputs`, `findings`).
    result: Any
    tolerance: Tolerance
    #: `phase("parallel")`: a `with` block whose wall and CPU seconds add to the result's timings.
    phase: Callable[[str], ContextManager]
    #: `attempt(step, check_id) -> (value, Raised | None)`: one step of the parallel model; a raise becomes
    #: that check's failure, with this rank's traceback kept.
    attempt: Callable
    extras: dict = field(default_factory=dict)


@runtime_checkable
class Adapter(Protocol):
    """A library's adapter (see the module docstring). Attributes and methods, all torch-free at import but
    `case_body`, `preload` and `simulate`."""

    #: The library's name: what a case's `library` says and `--models LIBRARY` selects.
    name: str
    #: The dtypes its cases run in (a run asking another refuses the adapter's cases by name).
    dtypes: tuple[str, ...]
    #: The check ids its ranks report: the report's columns for its cases.
    columns: tuple[CheckId, ...]

    def parse_layout(self, name: str, order: str = "cp-fastest") -> Any:
        """A layout name in this adapter's grammar; raises the layout error naming the rule."""

    def fixtures(self) -> dict[str, str]:
        """Bundled fixtures: name -> factory path (empty where the library is not installed)."""

    def installed(self) -> bool:
        """Whether the library is importable here."""

    def unsupported(self) -> str | None:
        """One line naming the installed version, what is missing and the supported range; None when served."""

    def claims(self, factory: Any) -> bool:
        """Whether a loaded `--spec` object (without a `library` attribute) is this adapter's."""

    def variants(self) -> tuple[str, ...]:
        """Every input variant name this adapter's models may offer."""

    def expand(self, request: CaseRequest) -> list:
        """The cases of `request`'s models: per model, layout and variant, the plain case, then the controls.
        Raises `ValueError` (or a subclass) naming the argument and the rule before any rank starts."""

    def controls(self) -> dict:
        """Negative controls by name (`domain.control.Control`)."""

    def case_options(self, case) -> list[str]:
        """The `paracheck run` options beyond the generic ones that pick `case` out again (replay commands)."""

    def case_body(self, ctx: CaseContext) -> ContextManager[CaseBody]:
        """Rank side: a `with` block (the library's scopes for one case) yielding the case's `CaseBody`."""

    def preload(self) -> None:
        """What the fork server imports once, before any rank forks (the library, the adapter's rank side)."""

    def explore_target(self, factory: str, layouts_text: str, world: int, order: str = "cp-fastest") -> tuple:
        """(space, layouts) `paracheck explore` draws for the model `factory` builds; errors name the rule."""

    def explore_case(self, name: str, factory: str, space, layout, shape, dtype: str, extras: dict | None = None
                     ) -> Any:
        """The `Case` explore runs for a drawn shape (`extras`: the draw's `uneven`, `options` and the run's
        `attention_backend`); ValueError names every rule the draw breaks."""

    def mixins(self) -> dict[str, str]:
        """Names `paracheck.testing` offers for this adapter's models -> "module:attribute" of each mixin."""



class _Nothing:
    """A `with` block that does nothing (contextlib's nullcontext, without importing it here)."""

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _absent(what: str):
    def default(who: str, *args):
        raise NotImplementedError(f"the {who} adapter has no {what}")
    return default


def _no_pass(check_id: CheckId):
    return lambda who: [CheckResult(check_id, Status.SKIP, f"the {who} adapter has no {check_id.value} pass")]


#: Every member an adapter may provide: `Adapter`'s, required, then these, each with the host's default.
ADAPTER = Spec("adapter", declared(Adapter, (
    #: (case) -> [options] | None: how a replay names the model where `--models NAME` or `--spec FACTORY` would not.
    optional("models_option", ("case",), lambda who, case: None),
    #: (case) -> frozenset | None: what the case's training covers when the default tier picks the layouts that
    #: train (`domain.tier`; None: its layout's kinds); the torch adapter adds each pair of kinds they compose.
    optional("training_parts", ("case",), lambda who, case: None),
    #: (case) -> bool: False for a case the adapter knows, before any rank starts, will be a skip.
    optional("will_run", ("case",), lambda who, case: True),
    #: (case) -> the model's class name, known before any rank starts ("" when it is not).
    optional("class_name", ("case",), lambda who, case: ""),
    #: (case) -> bool: whether the case's model generates, so parity.generate may run on it.
    optional("generates", ("case",), lambda who, case: False),
    #: () -> {group: [fixture names]}: the adapter's own names for several of its fixtures (`--models pipelines`).
    optional("groups", (), lambda who: {}),
    #: (draw, layout, uneven) -> [(name, value)]: the library options an explore draw adds.
    optional("draw_options", ("draw", "layout", "uneven"), lambda who, draw, layout, uneven: []),
    #: (SweepRequest) -> Swept: `--models LIBRARY:NAMES`, the library's own families, planned and built (what
    #: it cannot take is a ValueError naming the argument), for the host to launch.
    optional("sweep", ("request",), _absent("sweep of its library's families")),
    #: (backend, world, heads, layouts, order) -> [(layout name, [problems], groups)]: `topology` without --simulate,
    #: every layout of `world` ranks (or those `layouts` names) judged by the backend's rules and a head count.
    optional("topology_layouts", ("backend", "world", "heads", "layouts", "order"), _absent("topology by head count")),
    #: (TopologyRequest) -> exit code: `topology --simulate`, the adapter's models on a simulated world.
    optional("topology_simulate", ("request",), _absent("topology simulation")),
    #: () -> a `with` block: in a local world (`--local-world`), the library's rank-dependent functions run per
    #: rank inside it (`world.regions`); the default changes nothing.
    optional("local_scope", (), lambda who: _Nothing()),
    #: (case) -> (exception, site, why) | None: a case one process cannot run as every rank, known before it runs
    #: (`rank.localrun`): skipped as that local-world limit (`records.LOCAL_WORLD_LIMITS`) without building it.
    optional("local_limit", ("case",), lambda who, case: None),
    #: (control name) -> why the adapter cannot plant that control once per rank (`Control.per_rank`), None where it
    #: does. The registry asks it of every per-rank control as it gathers them; an adapter that does not say refuses.
    optional("per_rank_refusal", ("name",),
             lambda who, name: f"the {who} adapter does not say it plants a control once per rank (per_rank_refusal)"),
)))

#: Every member a case body may provide: `CaseBody`'s, required, then the optional passes.
CASE_BODY = Spec("case body", declared(CaseBody, (
    #: (checks): where a parity check failed on any rank, rerun that pass with hooks and attach the localization.
    optional("localize", ("checks",), lambda who, checks: None),
    optional("generate", (), _no_pass(CheckId.GENERATE)),
    optional("steps", (), _no_pass(CheckId.STEPS)),
    optional("checkpoint", (), _no_pass(CheckId.CHECKPOINT)),
)), state=True)

__all__ = ["ADAPTER", "CASE_BODY", "Adapter", "CaseBody", "CaseContext", "CaseRequest", "Member", "Refused",
           "SweepRequest", "Swept", "Tolerance", "TopologyRequest"]
