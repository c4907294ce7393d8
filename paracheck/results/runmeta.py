"""What a report says about its run (versions, backend, ranks, how the worlds started), as one record written to
and read from the report's JSON by the same code."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace


def _int(value):
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str(value):
    return value if isinstance(value, str) and value else None


@dataclass(frozen=True)
class RunMeta:
    """The run's own fields; `extra`: what a kind of run adds beside them (a sweep's families, a local world's
    share), written after them in the order given. A field a run does not know is None and left out of the JSON."""
    paracheck: str | None = None
    backend: str | None = None
    nproc: int | None = None
    versions: dict = field(default_factory=dict)
    worlds: int | None = None
    start_method: str | None = None
    references: int | None = None
    start_seconds: float | None = None
    extra: dict = field(default_factory=dict)

    def with_extra(self, **values) -> "RunMeta":
        clash = sorted(set(values) & {f.name for f in fields(self)})
        if clash:  # an extra would silently replace the run's own field in the JSON
            raise ValueError(f"RunMeta extra {', '.join(clash)}: a field of the record itself, not an extra")
        return replace(self, extra={**self.extra, **values})

    def to_json(self) -> dict:
        data = {"paracheck": self.paracheck, "backend": self.backend, "nproc": self.nproc, "versions": self.versions}
        started = {"worlds": self.worlds, "start_method": self.start_method, "references": self.references,
                   "start_seconds": self.start_seconds}
        data.update((k, v) for k, v in started.items() if v is not None)
        return dict(data, **self.extra)

    @classmethod
    def from_json(cls, data: dict) -> "RunMeta":
        """The record of a report's top level; never raises: a field that is not what the schema says reads as
        absent (an old or hand-made report still renders)."""
        versions = data.get("versions")
        seconds = data.get("start_seconds")
        return cls(paracheck=_str(data.get("paracheck")), backend=_str(data.get("backend")),
                   nproc=_int(data.get("nproc")), versions=versions if isinstance(versions, dict) else {},
                   worlds=_int(data.get("worlds")), start_method=_str(data.get("start_method")),
                   references=_int(data.get("references")),
                   start_seconds=seconds if isinstance(seconds, (int, float)) else None)
