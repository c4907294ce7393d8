"""Attribution: for the case a broken world was running, which ranks caused it and which only waited.

Pure: it reads a `WorldEnd` and the results the ranks managed to write, and returns one `RankResult`
per rank plus the events that broke the run. Causes, in order of evidence: a rank that raised (its own
traceback), a rank that died by a signal or exited with an error, and for a hang the ranks stuck where
the others are not. Everyone else waited on them, or lost a peer: `secondary`.
"""

from __future__ import annotations

import os
import re
import signal

from paracheck.domain.records import Failure, FailureKind, RankResult, RankStatus, RunEvent
from paracheck.launch.protocol import EndKind, RankExit, WorldEnd

# gloo's own words when the peer at the other end of a socket is gone.
_PEER_LOST = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|ECONNRESET|"
                        r"Socket Timeout|failed to recv|Read error", re.I)


def ranks_text(ranks) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    ranks, out, i = sorted(set(ranks)), [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(out)


def ranks_named(ranks) -> str:
    """[3] -> 'rank 3'; [0, 2, 3] -> 'ranks 0,2-3'."""
    ranks = sorted(set(ranks))
    return f"rank{'s' if len(ranks) > 1 else ''} {ranks_text(ranks)}"


def attribute(index: int, end: WorldEnd, written: dict[int, RankResult], timeout: float):
    """(one RankResult per rank for case `index`, the RunEvents) after `end` broke the world mid-case."""
    if end.kind == EndKind.HANG:
        return _hang(index, end, written, timeout)
    return _exit(index, end, written)


def _hang(index: int, end: WorldEnd, written: dict[int, RankResult], timeout: float):
    stuck = [r for r in range(len(end.codes)) if r not in written]
    where = {r: innermost(end.stacks.get(r, "")) for r in stuck}
    odd = odd_ones_out(where)
    message = (f"case {index} hung past --timeout {timeout:g}s; stuck ranks {stuck}: "
               + "; ".join(f"rank {r} in {w}" for r, w in where.items()))
    if odd:
        message += f"; likely cause: rank{'s' if len(odd) > 1 else ''} {odd}, stuck where the others are not"
    results = dict(written)
    for rank in stuck:
        stack = end.stacks.get(rank, "")
        results[rank] = RankResult(index, rank, RankStatus.ERROR, reason=f"hung past --timeout {timeout:g}s in {where[rank]}",
                                   secondary=bool(odd) and rank not in odd, stack=stack,
                                   failure=Failure(FailureKind.HANG, site=stuck_site(stack)))
    return [results[r] for r in sorted(results)], [RunEvent("hang", index, message)]


def _exit(index: int, end: WorldEnd, written: dict[int, RankResult]):
    results, events, causes = dict(written), [], set()
    for rank, code in enumerate(end.codes):
        if rank in written:
            if written[rank].status == RankStatus.ERROR and not _lost_peer(written[rank]):
                causes.add(rank)
            continue
        reason = _exit_reason(rank, code)
        if reason is None:
            continue
        causes.add(rank)
        if code is not None and code < 0:
            events.append(RunEvent("signal", index, reason))
        ended = signal.Signals(-code).name if code is not None and code < 0 else f"exit code {code}"
        results[rank] = RankResult(index, rank, RankStatus.ERROR, reason=reason, traceback=end.logs.get(rank, ""),
                                   failure=Failure(FailureKind.EXIT, exception=ended))
    if not causes:
        causes = {r for r, c in enumerate(end.codes) if c not in (None, 0)}
    for rank in range(len(end.codes)):
        if rank in causes:
            continue
        results[rank] = _secondary(index, rank, end, written.get(rank), causes)
    return [results[r] for r in sorted(results)], events


def _exit_reason(rank: int, code: int | None) -> str | None:
    """Why a rank without a result is a cause; None when it only stopped (or was stopped) for a peer."""
    if code is None or code == RankExit.BROKEN:
        return None
    if code < 0:
        return f"rank {rank} died by signal {signal.Signals(-code).name}"
    if code == 0:
        return f"rank {rank} exited 0 without a result for this case"
    return f"rank {rank} exited with code {code}"


def _secondary(index: int, rank: int, end: WorldEnd, own: RankResult | None, causes: set) -> RankResult:
    stack = end.stacks.get(rank, "")
    where = f" in {innermost(stack)}" if stack else ""
    if own is not None and own.status == RankStatus.ERROR:
        own.secondary = True
        own.reason = f"lost a peer ({ranks_named(causes)}): {own.reason}"
        return own
    return RankResult(index, rank, RankStatus.ERROR, reason=f"was waiting on {ranks_named(causes)}{where}",
                      secondary=True, stack=stack)


def lost_peer(text: str) -> bool:
    """Whether an error is gloo saying the rank at the other end of a socket is gone."""
    return bool(_PEER_LOST.search(text))


def _lost_peer(result: RankResult) -> bool:
    return result.secondary or lost_peer(result.traceback + result.reason)


def odd_ones_out(where: dict[int, str]) -> list[int]:
    """Ranks stuck at a frame fewer ranks share than the most common one: usually the ranks that
    entered a collective the others never reached (or skipped one they are waiting in)."""
    counts: dict[str, int] = {}
    for frame in where.values():
        counts[frame] = counts.get(frame, 0) + 1
    if len(counts) < 2:
        return []
    most = max(counts.values())
    return sorted(r for r, frame in where.items() if counts[frame] < most)


def _frames(stack: str) -> tuple[list, tuple | None]:
    """The main thread's frames (file, line, function) of a faulthandler dump, innermost first, and the
    innermost one outside torch (None when that is the innermost itself)."""
    blocks = stack.split("\n\n")
    main = next((b for b in blocks if "Current thread" in b), blocks[0] if blocks else "")
    frames = re.findall(r'File "(.+)", line (\d+) in (\S+)', main)
    outside = next((f for f in frames if f"{os.sep}torch{os.sep}" not in f[0] and "<frozen" not in f[0]
                    and "multiprocessing" not in f[0]), None)
    return frames, (None if not frames or outside == frames[0] else outside)


def innermost(stack: str) -> str:
    """Where a rank sits in a faulthandler dump: its innermost frame, and the innermost outside torch."""
    frames, outside = _frames(stack)
    if not frames:
        return "an unknown frame (no stack was captured)"

    def fmt(frame):
        return f"{os.path.basename(frame[0])}:{frame[1]} in {frame[2]}"

    return fmt(frames[0]) if outside is None else f"{fmt(frames[0])}, called from {fmt(outside)}"


def stuck_site(stack: str) -> str:
    """`module.function` of where a stuck rank sits (the innermost frame outside torch when there is one),
    without line numbers: the hang's identity."""
    frames, outside = _frames(stack)
    if not frames:
        return ""
    frame = outside or frames[0]
    return f"{os.path.splitext(os.path.basename(frame[0]))[0]}.{frame[2]}"
