"""What the installed transformers needs beyond itself that a case's loading asks for, checked before any rank
starts, from the installed packages' metadata alone (no torch, no transformers import).

transformers 5.25 made `kernels` a requirement of its own (`Requires-Dist` with no extra) and turned hub kernels on by
default: `from_pretrained`, which every transformers case loads its model with, calls `set_use_kernels(True)` unless
`USE_HUB_KERNELS` is off, and that raises "Kernels are not available" when `kernels` is missing or out of the
range. Left to the ranks, that is one identical error per case (57 in the default run); here it is one line, exit 2.
Where the switch is off the load asks for nothing, and the cases run.
"""

from __future__ import annotations

import os

#: requirement name -> (what asks for it, whether it asks now): the requirements a case's loading reads.
ASKED = {
    "kernels": ("from_pretrained (hub kernels are on by default; USE_HUB_KERNELS=0 turns them off), which every "
                "transformers case loads its model with",
                lambda: os.environ.get("USE_HUB_KERNELS", "YES").upper() in {"1", "ON", "YES", "TRUE"}),
}


def missing() -> str | None:
    """One line naming each requirement of the installed transformers that its loading asks for and that is
    missing or out of range; None when there is none."""
    from importlib import metadata

    from packaging.requirements import Requirement

    try:
        version = metadata.version("transformers")
        declared = [Requirement(text) for text in metadata.requires("transformers") or ()]
    except metadata.PackageNotFoundError:
        return None
    problems = []
    for req in declared:
        if req.name not in ASKED or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue  # not asked for by a case, or an extra's
        asker, asks = ASKED[req.name]
        have = _installed(req.name)
        if asks() and (have is None or not req.specifier.contains(have, prereleases=True)):
            found = "not installed" if have is None else f"{have} installed"
            problems.append(f"transformers {version} requires {req.name}{req.specifier} ({found}), asked for by its "
                            f"{asker}: pip install '{req.name}{req.specifier}'")
    return "; ".join(dict.fromkeys(problems)) or None


def _installed(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
