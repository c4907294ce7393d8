"""Typed, torch-free records of what a run found: a check on one rank, a rank's case, a merged verdict.

JSON exists only at the file boundary: the worker writes `RankResult.to_json()`, the launcher reads
`RankResult.from_json()`, and the report writes `Verdict.to_json()`. Everything between passes these
objects, so a field is named once and read by attribute.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field, fields


class CheckId(str, enum.Enum):
    """The stable check ids (the contract); `short` is the report's column name."""
    MESH = "structure.mesh"
    CP_HOOKS = "structure.cp_hooks"
    PROCESSOR_CONFIG = "structure.processor_config"
    TP_SHARDS = "structure.tp_shards"
    COLLECTIVES = "structure.collectives"
    FORWARD = "parity.forward"
    GRADS = "parity.grads"
    INFERENCE = "parity.inference"
    LOSS = "parity.loss"

    @property
    def short(self) -> str:
        return _SHORT[self]

    @property
    def structural(self) -> bool:
        return self.value.startswith("structure.")


_SHORT = {CheckId.MESH: "mesh", CheckId.CP_HOOKS: "hooks", CheckId.PROCESSOR_CONFIG: "procs",
          CheckId.TP_SHARDS: "shards", CheckId.COLLECTIVES: "colls", CheckId.FORWARD: "fwd", CheckId.GRADS: "grads",
          CheckId.INFERENCE: "infer", CheckId.LOSS: "loss"}


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


def _jsonable(value):
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


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

    def to_json(self) -> dict:
        return _jsonable(asdict(self))

    @classmethod
    def from_json(cls, data: dict) -> "CheckResult":
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k in known}
        return cls(**dict(data, id=CheckId(data["id"]), status=Status(data["status"])))


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
    traceback: str = ""
    #: This rank raised after collectives began: its peers may be stuck.
    raised_in_parallel: bool = False
    #: This rank failed only because of a peer (it waited on one, or lost one).
    secondary: bool = False
    hung: bool = False
    #: Where a stopped rank was (faulthandler dump), when it was stopped.
    stack: str = ""
    seconds: float = 0.0
    attention_backend: str | None = None
    #: A skip because the model has no plan for this kind of parallelism at all.
    never: bool = False
    #: The model class's name, for known-failure entries that name it.
    model_class: str | None = None
    #: Seconds spent per phase on this rank: reference, parallel, checks.
    timings: dict = field(default_factory=dict)
    #: This rank's peak resident memory so far, in MiB, when the case ended.
    peak_rss_mb: float = 0.0
    #: This rank's resident memory in MiB when the case ended: growth over cases shows here after the peak.
    rss_mb: float = 0.0
    #: CPU seconds (user + system) this rank process has used since it started, when the case ended.
    cpu_seconds: float = 0.0

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
        return cls(**data)


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

    def to_json(self) -> dict:
        return _jsonable(asdict(self))


@dataclass
class Finding:
    """A library warning and the ranks that saw it."""
    message: str
    ranks: list[int]


@dataclass
class RunEvent:
    """Something that broke the run itself: a hang, a signal, a world that would not start."""
    kind: str  # hang | signal | start
    index: int | None
    message: str

    def to_json(self) -> dict:
        return asdict(self)
