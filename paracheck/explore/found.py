"""Found cases: what `paracheck explore` writes to `--out` for each failure, and reads back to try first.

Each failure becomes a `--spec` factory file (the model's factory called with the minimal shape; for a
transformers model one that says `library = "transformers"`) whose docstring holds the command that replays
it, and an entry in `found.json`, from which the next `explore` rebuilds the case. Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
from dataclasses import dataclass

from paracheck.domain.registry import parse_layout
from paracheck.domain.case import Case, options_text
from paracheck.launch.protocol import write_json

INDEX = "found.json"


@dataclass(frozen=True)
class Found:
    """One failure explore found and shrank: the minimal case and how it failed."""
    case: Case
    signature: str
    detail: str

    def to_json(self) -> dict:
        return {"case": self.case.to_json(), "signature": self.signature, "detail": self.detail}

    @classmethod
    def from_json(cls, data: dict) -> "Found":
        return cls(Case.from_json(data["case"], parse_layout), data["signature"], data["detail"])

    @property
    def stem(self) -> str:
        digest = hashlib.sha1(json.dumps(self.case.to_json(), sort_keys=True).encode()).hexdigest()[:8]
        return f"{_identifier(self.case.model)}-{self.case.layout.name}-{digest}"


def read(out: str) -> list[Found]:
    """The cases found by earlier runs into `out` (none when it has no index yet)."""
    path = os.path.join(out, INDEX)
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [Found.from_json(entry) for entry in json.load(handle)]


def write(out: str, found: Found, nproc: int, backend: str | None, no_known: bool, versions: dict) -> tuple[str, str]:
    """Write the spec file and add `found` to the index; returns (spec path, replay command)."""
    os.makedirs(out, exist_ok=True)
    spec_path = os.path.join(out, found.stem + ".py")
    function = _identifier(found.case.model)
    command = replay_command(found.case, f"{spec_path}:{function}", nproc, backend, no_known)
    with open(spec_path, "w") as handle:
        handle.write(_spec_text(found, function, command, versions))
    entries = [f for f in read(out) if f.stem != found.stem] + [found]
    write_json(os.path.join(out, INDEX), [f.to_json() for f in entries])
    return spec_path, command


def replay_command(case: Case, spec: str, nproc: int, backend: str | None, no_known: bool) -> str:
    """`paracheck run` on the spec file, with the options that pick this case out (`report.case_options`)."""
    from paracheck.results.report import case_options

    parts = ["paracheck", "run", "--spec", spec, "--layouts", case.layout.name, "--nproc", str(nproc)]
    parts += case_options(case) + (["--backend", backend] if backend else [])
    parts += ["--known-failures", "none"] if no_known else []
    return " ".join(shlex.quote(p) for p in parts)


def _spec_text(found: Found, function: str, command: str, versions: dict) -> str:
    c = found.case
    made_with = ", ".join(f"{k} {v}" for k, v in versions.items() if v)
    return f'''"""{c.model} on {c.layout.name} fails: {found.signature}

Found and shrunk by `paracheck explore` ({made_with}).
Inputs: {c.shape.describe()}; dtype {c.dtype}; CP options {options_text(c.cp_options) or "none"}.
First failure: {found.detail}

Replay:
    {command}
"""

from paracheck.domain.case import load_factory
from paracheck.domain.shapes import Shape

SHAPE = Shape.from_json({c.shape.to_json()!r})


def {function}(variant={c.variant!r}):
    return load_factory({c.factory!r})(shape=SHAPE)


# The variant this shape falls under, so known-failure entries apply on replay as they did in explore.
{function}.variants = ({c.variant!r},)
{_library_line(function, c.library)}'''


def _library_line(function: str, library: str) -> str:
    """A found spec says whose it is, so `run` hands it to that adapter."""
    return f"{function}.library = {library!r}\n"


def _identifier(name: str) -> str:
    text = re.sub(r"\W", "_", os.path.basename(name).rsplit(":", 1)[-1])
    return text if text and not text[0].isdigit() else f"case_{text}"

