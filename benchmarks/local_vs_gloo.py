"""Compare a `--local-world N` report with a gloo `--nproc N` report of the same cases (docs/local-world.md).

    paracheck run --local-world 4 --models flux --variants base --controls --report-json local.json
    paracheck run --nproc 4 --models flux --variants base --controls --report-json gloo.json
    python benchmarks/local_vs_gloo.py local.json gloo.json

Prints, per case both ran: a status that differs, a check whose status or failing ranks differ, and the largest
max_abs difference over the checks both ran (a local world takes no steps, save or generation: those checks and
the controls that show only there are left out, and counted). A case the local world skipped as its own limit
(`one process cannot run this case as every rank`: docs/local-world.md) is counted apart and listed, not a
disagreement. Exit 1 on any disagreement.
"""

from __future__ import annotations

import json
import re
import sys

from paracheck.domain.records import LOCAL_WORLD_SKIP  # torch-free: the words a local-world skip begins with

LATER = {"parity.steps", "checkpoint.roundtrip", "parity.generate"}


def _cases(path: str) -> dict:
    return {c["id"]: c for c in json.load(open(path))["cases"]}


_WHERE = re.compile(r"(\S+):\d+ \(")


def kits_own(reason: str) -> bool:
    """Whether a local world's skip names the kit's own line as where one rank's value was needed: the first frame
    outside torch is paracheck's and no line of torch's own needed it (a planter slicing by `dist.get_rank()`); a
    need inside torch (FSDP2's chunk pick, called from the kit's torch adapter) or the library's is a limit."""
    frames = _WHERE.findall(reason)
    return bool(frames) and all("/paracheck/" in f and not re.search(r"-packages/torch/", f) for f in frames)


def compare(local: dict, gloo: dict, limits: list | None = None) -> tuple[list[str], float, int, int]:
    """(disagreements, the largest max_abs difference, cases compared, cases left out); the cases skipped as a
    local world's limit are appended to `limits` (with gloo's status), not compared."""
    found, worst, compared, left_out = [], 0.0, 0, 0
    for case_id, ours in sorted(local.items()):
        theirs = gloo.get(case_id)
        if theirs is None or "local world (--local-world) takes no" in ours.get("reason", ""):
            left_out += 1
            continue
        if ours["status"] == "skip" and ours.get("reason", "").startswith(LOCAL_WORLD_SKIP):
            if kits_own(ours["reason"]):  # the kit's own code needed one rank's value: its bug, not a limit
                found.append(f"{case_id}: skip here ({ours['reason'][:160]}), {theirs['status']} on gloo")
                continue
            if limits is not None:
                limits.append(f"{case_id}: {theirs['status']} on gloo; here {ours['reason'][:140]}")
            continue
        compared += 1
        if ours["status"] != theirs["status"]:
            found.append(f"{case_id}: {ours['status']} here, {theirs['status']} on gloo ({ours['reason'][:120]})")
        other = {c["id"]: c for c in theirs["checks"]}
        for check in ours["checks"]:
            peer = other.get(check["id"])
            if peer is None or check["id"] in LATER or check["status"] == "skip" or peer["status"] == "skip":
                continue
            if (check["status"], check["failed_ranks"]) != (peer["status"], peer["failed_ranks"]):
                found.append(f"{case_id} {check['id']}: {check['status']} {check['failed_ranks']} here, "
                             f"{peer['status']} {peer['failed_ranks']} on gloo")
            if check["max_abs"] is not None and peer["max_abs"] is not None:
                worst = max(worst, abs(check["max_abs"] - peer["max_abs"]))
    return found, worst, compared, left_out


def main(argv: list[str]) -> int:
    limits: list[str] = []
    found, worst, compared, left_out = compare(_cases(argv[0]), _cases(argv[1]), limits)
    for line in found:
        print(line)
    for line in limits:
        print(f"limit {line}")
    print(f"{compared} cases compared, {left_out} left out, {len(limits)} a local world's limit, "
          f"{len(found)} disagreements, largest max_abs difference {worst:.1e}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
