"""Typed, torch-free records of what a run found: a check on one rank, a rank's case, a merged verdict.

JSON exists only at the file boundary: the worker writes `RankResult.to_json()`, the launcher reads
`RankResult.from_json()`, and the report writes `Verdict.to_json()`. Everything between passes these
objects, so a field is named once and read by attribute.
"""

from __future__ import annotations

import enum
import os
import sysconfig
import traceback
from dataclasses import asdict, dataclass, field, fields

from paracheck.domain.localization import integer, ints, number, text


class CheckId(str, enum.Enum):
    """The stable check ids (the contract); `short` is the report's column name."""
    MESH = "structure.mesh"
    CP_HOOKS = "structure.cp_hooks"
    PROCESSOR_CONFIG = "structure.processor_config"
    TP_SHARDS = "structure.tp_shards"
    COLLECTIVES = "structure.collectives"
    FORWARD = "parity.forward"
    INFERENCE = "parity.inference"
    GRADS = "parity.grads"
    LOSS = "parity.loss"
    #: N optimizer steps: the loss and every gathered parameter after each step.
    STEPS = "parity.steps"
    #: Save and load: gathered save_pretrained, a sharded save to the same layout and another one, resume.
    CHECKPOINT = "checkpoint.roundtrip"
    #: Greedy generation on the parallel model: the tokens on every rank and each decode step's logits.
    GENERATE = "parity.generate"
    #: A diffusers pipeline's denoising loop: the latents after every step, the final latents, the decoded image.
    PIPELINE = "parity.pipeline"
    #: A backend's rules on the process groups the library built; judged by `topology --simulate` only.
    BACKEND_GROUPS = "backend.groups"

    @property
    def short(self) -> str:
        return _SHORT[self]

    @property
    def simulated(self) -> bool:
        """Judged by a simulation only: no rank of a run reports it."""
        return self is CheckId.BACKEND_GROUPS

    @property
    def structural(self) -> bool:
        return self.value.startswith("structure.")


_SHORT = {CheckId.MESH: "mesh", CheckId.CP_HOOKS: "hooks", CheckId.PROCESSOR_CONFIG: "procs",
          CheckId.TP_SHARDS: "shards", CheckId.COLLECTIVES: "colls", CheckId.FORWARD: "fwd", CheckId.INFERENCE: "infer",
          CheckId.GRADS: "grads", CheckId.LOSS: "loss",
          CheckId.STEPS: "steps", CheckId.CHECKPOINT: "ckpt", CheckId.GENERATE: "gen", CheckId.PIPELINE: "pipe",
          CheckId.BACKEND_GROUPS: "groups"}


class Status(str, enum.Enum):
    """One check's outcome."""
    PASS = "pass"
    FAIL = "fail"
    SKIP = "skip"


class RankStatus(str, enum.Enum):
    """How a case ended on one rank (its checks say whether it was right)."""
    OK = "ok"
    SKIP = "skip"
    ERROR = "error"


class CaseStatus(str, enum.Enum):
    """A case's verdict over every rank (the contract's statuses)."""
    PASS = "pass"
    FAIL = "fail"
    ERROR = "error"
    SKIP = "skip"
    DETECTED = "detected"
    MISSED = "missed"
    INCONCLUSIVE = "inconclusive"
    XFAIL = "xfail"
    XPASS = "xpass"

    @property
    def failing(self) -> bool:
        return self in (CaseStatus.FAIL, CaseStatus.ERROR, CaseStatus.MISSED)


class Route(str, enum.Enum):
    AUTO = "auto"
    NATIVE = "native"
    COMPOSED = "composed"
    SHARDED_LOAD = "sharded-load"
    #: diffusers' Neuron tensor-parallel path (`native` or `composed` as `auto` picks), on a CPU world with the
    #: Neuron device stood in for (`adapters.diffusers.library.neuron_tensor_parallel`).
    NEURON_TP = "neuron-tp"


class FailureKind(str, enum.Enum):
    """What kind of thing failed: a check that found wrong numbers or structure, code that raised, a rank
    stuck past --timeout, a rank process that died, or a case that cannot run here."""
    CHECK = "check"
    RAISE = "raise"
    HANG = "hang"
    EXIT = "exit"
    SKIP = "skip"
    #: Ranks decided differently about the same case (some skipped it, some ran it).
    DISAGREE = "disagree"


#: Exceptions, by class name, that are a local world's limit rather than the case's failure (`--local-world`:
#: Python that needs one value of a per-rank one, an operation torch's LocalTensorMode has no rule for).
LOCAL_WORLD_LIMITS = ("RankDependent", "NoLocalRule")
#: How a case a local world cannot run begins its skip reason (written by `rank.localrun`, read by the benchmark).
LOCAL_WORLD_SKIP = "one process cannot run this case as every rank"

#: torch's own rules a local world stands a corrected one in for while it lives, each with its upstream report:
#: every `--local-world` report lists them (`local_world.stood_in`), so the stand-in stays visible.
LOCAL_WORLD_STOOD_IN = (
    ("torch.distributed._local_tensor._c10d._local_all_gather_",
     "dist.all_gather (list form) over a subgroup hands every rank the last group's tensors (torch 2.13)",
     "docs/upstream/localtensor_all_gather.md"),
    ("torch.distributed.fsdp._fully_shard._fsdp_param.alloc_storage, free_storage",
     "FSDP2 resizes an unsharded parameter's storage, which a LocalTensor has none of (\"Attempted to call "
     "resize_() on an invalid python storage\", torch 2.13); resized per rank instead",
     "docs/upstream/localtensor_fsdp_storage.md"),
    ("torch.distributed._local_tensor._for_each_rank_run_func",
     "an op drawing from an explicit torch.Generator hands rank r the (r+1)-th draw of the one shared generator "
     "(torch 2.13); each rank draws from the generator's state before the op instead",
     "docs/upstream/localtensor_generator.md"),
)


@dataclass(frozen=True)
class Failure:
    """A failure's identity, filled where it happens and carried as is: explore de-duplicates by it and the
    report groups skips by it, so rewording a message changes neither. No field holds prose."""
    kind: FailureKind
    #: The check that failed (or during whose step the code raised).
    check: CheckId | None = None
    #: The exception's class name (the library's cause, when a library entry point wrapped it); for a
    #: rank process that ended, the signal's name or its exit code.
    exception: str = ""
    #: Where it was raised or where a rank was stuck: `module.function` of the innermost frame (no line).
    site: str = ""
    #: The library entry point it was raised inside (`library.entry_point`), if any.
    entry_point: str = ""
    #: A skip because the model lacks this plan attribute altogether (`_tp_plan`, `_cp_plan`).
    missing_plan: str = ""
    #: Whose code raised (`raised_by`): "kit" where the innermost frame outside torch and Python's own modules is
    #: paracheck's (a planter, a check: the kit's bug), "library" where it is the code under test's.
    raised_by: str = ""

    @property
    def key(self) -> str:
        """The identity as one stable string (no numbers that change with the shape, no message text)."""
        parts = [self.kind.value, self.check.value if self.check else "", self.exception, self.entry_point,
                 self.site, self.missing_plan]
        return " ".join(p for p in parts if p)

    @classmethod
    def raised(cls, exc: BaseException, check: CheckId | None = None) -> "Failure":
        """The identity of an exception caught where it was raised (its traceback is still attached)."""
        entry_point = getattr(exc, "entry_point", "")
        cause = getattr(exc, "cause", None) if entry_point else None
        root = cause if isinstance(cause, BaseException) else exc
        return cls(FailureKind.RAISE, check, type(root).__name__, _site(root.__traceback__), entry_point,
                   raised_by=raised_by(root.__traceback__))

    def to_json(self) -> dict:
        return _jsonable(asdict(self))

    @classmethod
    def from_json(cls, data) -> "Failure | None":
        """None where `data` is no failure of a kind this version knows; a field that is not the schema's reads
        as absent (a check this version does not know, a name that is no text)."""
        kind = enum_value(FailureKind, data.get("kind")) if isinstance(data, dict) else None
        if kind is None:
            return None
        names = {f.name: text(data.get(f.name)) or "" for f in fields(cls) if f.name not in ("kind", "check")}
        return cls(kind, enum_value(CheckId, data.get("check")), **names)


def enum_value(kind: type[enum.Enum], value):
    """`kind(value)`, or None where `value` is none of its values (a report from another version)."""
    try:
        return kind(value)
    except (ValueError, TypeError):
        return None


def _site(tb) -> str:
    frames = traceback.extract_tb(tb) if tb is not None else []
    if not frames:
        return ""
    frame = frames[-1]
    return f"{os.path.splitext(os.path.basename(frame.filename))[0]}.{frame.name}"


_KIT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep


def _torch_folder() -> str:
    """torch's installed folder, found without importing it (this module is torch-free); "" where it is absent."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    return os.path.dirname(spec.origin) + os.sep if spec is not None and spec.origin else ""


def raised_by(tb) -> str:
    """"kit" where the innermost frame of `tb` outside torch and Python's own modules is paracheck's, else
    "library": a raise inside torch (a shape check, a collective) is blamed on the code that called it. torch is
    its installed folder, not a path holding "torch" (the kit's own adapters/torch is the kit's)."""
    torch_folder = _torch_folder()
    for frame in reversed(traceback.extract_tb(tb) if tb is not None else []):
        name = os.path.abspath(frame.filename)
        if (torch_folder and name.startswith(torch_folder)) or (name.startswith(_STDLIB) and "-packages" not in name):
            continue
        return "kit" if name.startswith(_KIT) else "library"
    return "library"


def _jsonable(value):
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


#: In a check's `data`: set where it passed only beyond the single-device reference's precision (`checks.steps`'
#: "beyond": that reference itself too far from the exact computation for the tolerance to judge the run, on a step
#: or an evaluation), which the console and the support matrix name (`passed_beyond`).
BEYOND_PRECISION = "beyond_reference_precision"


def passed_beyond(per_rank: dict | None) -> bool:
    """Whether a check passed on some rank (`per_rank`: rank -> its result's data) only beyond the reference's
    precision (`BEYOND_PRECISION`)."""
    return any(held.get(BEYOND_PRECISION) for held in (per_rank or {}).values())


#: In a check's `data`: fields its case's JSON carries at the top level (the worst rank's, by the check's max_abs),
#: e.g. a pipeline's per-step error curve and its pictures (`results.verdict.Verdict.to_json`).
TO_CASE = "case"


@dataclass
class CheckResult:
    """One check on one rank."""
    id: CheckId
    status: Status
    detail: str = ""
    max_abs: float | None = None
    max_rel: float | None = None
    atol: float | None = None
    rtol: float | None = None
    #: Extra figures a check reports (e.g. collective counts); plain JSON values.
    data: dict = field(default_factory=dict)
    #: What failed, when the check failed (a raise during its step, or the check's own finding).
    failure: Failure | None = None
    #: The parts a check is made of, where it has several run alike (generation's cache modes): name -> passed.
    #: A control is judged on the parts its plain case passes (`verdict.judge_controls`).
    facets: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return _without_empty_facets(_jsonable(asdict(self)))

    @classmethod
    def from_json(cls, data: dict) -> "CheckResult":
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k in known}
        return cls(**dict(data, id=CheckId(data["id"]), status=Status(data["status"]),
                          failure=Failure.from_json(data.get("failure"))))


@dataclass
class RankResult:
    """One case on one rank. Why it failed lives in fields, never in a message to be parsed later."""
    index: int
    rank: int
    status: RankStatus
    reason: str = ""
    route: Route | None = None
    checks: list[CheckResult] = field(default_factory=list)
    #: Library warnings this rank saw (e.g. "split will not be applied"), raw.
    findings: list[str] = field(default_factory=list)
    #: Config changes fitting made, e.g. "num_attention_heads 3->4".
    fit: list[str] = field(default_factory=list)
    #: Where the case's control planted, where only the case knows it (`Control.plants_in` "{planted}").
    planted_in: str | None = None
    traceback: str = ""
    #: This rank raised after collectives began: its peers may be stuck.
    raised_in_parallel: bool = False
    #: This rank failed only because of a peer (it waited on one, or lost one).
    secondary: bool = False
    #: Why the case did not pass here, typed (None when it passed); never parsed from `reason`.
    failure: Failure | None = None
    #: Where a stopped rank was (faulthandler dump), when it was stopped.
    stack: str = ""
    seconds: float = 0.0
    attention_backend: str | None = None
    #: The model class's name, for known-failure entries that name it.
    model_class: str | None = None
    #: What the case's inputs carry ("mask", "padded"), for known-failure entries keyed on it.
    inputs: list[str] = field(default_factory=list)
    #: Seconds spent per phase on this rank: reference, parallel, checks.
    timings: dict = field(default_factory=dict)
    #: This rank's peak resident memory so far, in MiB, when the case ended.
    peak_rss_mb: float = 0.0
    #: This rank's resident memory in MiB when the case ended: growth over cases shows here after the peak.
    rss_mb: float = 0.0
    #: CPU seconds (user + system) this rank process has used since it started, when the case ended.
    cpu_seconds: float = 0.0
    #: This rank's threads when the case ended (gloo's included: three per process group).
    threads: int = 0
    #: Process groups this rank held when the case ended, the default group included.
    process_groups: int = 0

    def check(self, check_id: CheckId) -> CheckResult | None:
        return next((c for c in self.checks if c.id == check_id), None)

    def to_json(self) -> dict:
        data = _jsonable(asdict(self))
        data["checks"] = [c.to_json() for c in self.checks]
        return data

    @classmethod
    def from_json(cls, data: dict) -> "RankResult":
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k in known}
        data["status"] = RankStatus(data["status"])
        data["route"] = Route(data["route"]) if data.get("route") else None
        data["checks"] = [CheckResult.from_json(c) for c in data.get("checks", [])]
        data["failure"] = Failure.from_json(data.get("failure"))
        return cls(**data)

    @property
    def never(self) -> bool:
        """A skip because the model has no plan for this kind of parallelism at all."""
        return bool(self.failure and self.failure.missing_plan)


@dataclass
class MergedCheck:
    """One check over every rank: which ranks failed, the worst figures, the first failing detail."""
    id: CheckId
    status: Status
    failed_ranks: list[int] = field(default_factory=list)
    max_abs: float | None = None
    max_rel: float | None = None
    atol: float | None = None
    rtol: float | None = None
    detail: str = ""
    #: The rank whose detail is shown.
    detail_rank: int | None = None
    data: dict = field(default_factory=dict)
    #: The shown rank's failure (see `CheckResult.failure`).
    failure: Failure | None = None
    #: Each part's status over every rank (a part fails where it failed on any rank; see `CheckResult.facets`).
    facets: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return _without_empty_facets(_jsonable(asdict(self)))

    @classmethod
    def from_json(cls, data) -> "MergedCheck | None":
        """What `to_json` wrote; None where `data` is no check this version knows (its id or status is none of
        ours). Any other field that is not the schema's reads as absent."""
        if not isinstance(data, dict):
            return None
        check_id, status = enum_value(CheckId, data.get("id")), enum_value(Status, data.get("status"))
        if check_id is None or status is None:
            return None
        held, facets = data.get("data"), data.get("facets")
        return cls(check_id, status, ints(data.get("failed_ranks")), number(data.get("max_abs")),
                   number(data.get("max_rel")), number(data.get("atol")), number(data.get("rtol")),
                   text(data.get("detail")) or "", integer(data.get("detail_rank")),
                   dict(held) if isinstance(held, dict) else {}, Failure.from_json(data.get("failure")),
                   {str(k): v for k, v in facets.items() if isinstance(v, bool)} if isinstance(facets, dict) else {})


def _without_empty_facets(data: dict) -> dict:
    """A check without parts writes none (the JSON of every older check stays as it was)."""
    if not data.get("facets"):
        data.pop("facets", None)
    return data


@dataclass
class Finding:
    """A library warning and the ranks that saw it."""
    message: str
    ranks: list[int]

    def to_json(self) -> dict:
        return {"message": self.message, "ranks": list(self.ranks)}

    @classmethod
    def from_json(cls, data) -> "Finding | None":
        message = text(data.get("message")) if isinstance(data, dict) else None
        return None if message is None else cls(message, ints(data.get("ranks")))


@dataclass
class RunEvent:
    """Something that broke the run itself: a hang, a signal, a world that would not start. `index` counts the
    launched cases (as the progress lines do); `case` is the id of the verdict it broke, where there is one (set
    when the run is judged, its route resolved)."""
    kind: str  # hang | signal | start | interrupted
    index: int | None
    message: str
    case: str = ""

    def to_json(self) -> dict:
        return asdict(self)

    def declared_by(self, status: str | None, failure_kind: str | None) -> bool:
        """Whether this is a hang its case's verdict (`status`, its failure's `failure_kind`, as the JSON report
        spells them) declares: an xfail on the hang itself, which only an entry naming the hang gives
        (`results.known`). Such a hang is expected: it does not break the run, and stays among the events."""
        return self.kind == "hang" and status == "xfail" and failure_kind == "hang"

    @classmethod
    def from_json(cls, data) -> "RunEvent | None":
        """What `to_json` wrote; None where `data` is no object, a field that is not the schema's read as absent."""
        if not isinstance(data, dict):
            return None
        return cls(text(data.get("kind")) or "", integer(data.get("index")), text(data.get("message")) or "",
                   text(data.get("case")) or "")


@dataclass(frozen=True)
class Raised:
    """A step of the parallel model raised: the message for the report, and the typed identity."""
    message: str
    failure: Failure

    def __str__(self) -> str:
        return self.message
