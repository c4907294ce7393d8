"""Which failing cases a rank does not rerun with localization's hooks: those declared known failures explain whole.

A declared failure's rerun costs about what the case cost again, in every run, and it says where a bug lives that
its entry (`results.known`) already names, with a reproduction: in the default run, 42 declared cases spent 22 s
of 133 case-seconds there. The rerun is skipped where every check that failed on any rank is one that an entry
matching the case declares (an entry with a `message` glob does not count: what it must match is the verdict's
words, not a rank's); the case's localization then says why it was not rerun. `PARACHECK_LOCALIZE=all` reruns them too.

Every rank decides alike, or one would wait in the rerun's collectives for peers that skipped it: the entries
that may meet the case are read from the case and the model class (alike on every rank), and what failed and
which entries match (the route and inputs each rank resolved, and an entry's `site`: the typed origin of each
check it names, on every rank where that check failed) come from one all-reduce, taken only for a case some entry
may meet.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
import torch.distributed as dist

from paracheck.domain.records import CheckId, Status
from paracheck.results import localization
from paracheck.results.known import KnownFailure, explaining_entries

#: The entries this rank's run declared (`use`), as the launcher wrote them into run.json.
_entries: list[KnownFailure] = []


def use(entries: list[dict]) -> None:
    """The run's declared entries, each as `dataclasses.asdict` wrote it."""
    _entries[:] = [KnownFailure(**e) for e in entries]


def reruns_declared() -> bool:
    return os.environ.get("PARACHECK_LOCALIZE") == "all"


def explained(case, result, checks: list) -> str | None:
    """The entries' reasons when declared failures explain every check that failed on any rank, else None.
    A collective over the world where an entry may meet the case; none otherwise."""
    if reruns_declared():
        return None
    candidates = [e for e in _entries if e.message == "*" and e.check != "error"
                  and e.may_meet(case, result.model_class or "")]
    if not candidates:
        return None
    ids = list(CheckId)
    failed = {c.id for c in checks if c.status == Status.FAIL}
    resolved = SimpleNamespace(case=case, model_class=result.model_class or "", route=result.route or case.route,
                               inputs=result.inputs)
    # MAX over ranks: a check failed on some rank; an entry is out where some rank's resolved case does not match,
    # or where a check it names failed on some rank at another site than its glob.
    flags = torch.tensor([float(i in failed) for i in ids] +
                         [float(not e.matches(resolved) or not _at_its_site(e, checks)) for e in candidates])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    failing = {i for i, f in zip(ids, flags[:len(ids)].tolist()) if f > 0}
    matched = [e for e, out in zip(candidates, flags[len(ids):].tolist()) if out == 0]
    if not failing:
        return None  # nothing to rerun, nor to say why not
    return "; ".join(dict.fromkeys(e.reason for e in explaining_entries(failing, matched))) or None


def _at_its_site(entry: KnownFailure, checks: list) -> bool:
    """Whether every check `entry` names that failed on this rank failed at the entry's `site` (a typed origin).
    Held on every rank, so the verdict's merged failure, one of theirs, matches the entry too."""
    named = set(entry.check_ids) or {c.id for c in checks}
    return all(entry.site_matches(c.failure) for c in checks if c.status == Status.FAIL and c.id in named)


def not_rerun(checks: list, reasons: str) -> None:
    """Say on each failing parity check why its case was not rerun with hooks."""
    why = (f"not rerun with hooks: a declared known failure explains it ({reasons}); PARACHECK_LOCALIZE=all "
           "reruns declared failures too")
    for check in checks:
        if check.id in (CheckId.FORWARD, CheckId.INFERENCE, CheckId.GRADS, CheckId.PIPELINE) and check.status == Status.FAIL:
            check.data.setdefault(localization.KEY, {})[localization.NOT_RUN] = why
