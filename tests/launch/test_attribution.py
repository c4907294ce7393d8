"""Which ranks caused a broken world and which only waited: pure, table-driven."""

import pytest

from paracheck.launch.attribution import attribute, innermost, odd_ones_out, ranks_text
from paracheck.launch.protocol import RankExit
from paracheck.domain.records import RankResult, RankStatus
from paracheck.launch.protocol import EndKind, WorldEnd


def _stack(*frames):
    lines = "\n".join(f'  File "{path}", line {line} in {fn}' for path, line, fn in frames)
    return f"Current thread 0x01 (most recent call first):\n{lines}\n"


COLLECTIVE = _stack(("/x/torch/distributed/distributed_c10d.py", 3252, "all_reduce"), ("/w/specs.py", 51, "f"))
WAITING = _stack(("/x/torch/distributed/distributed_c10d.py", 4000, "barrier"), ("/w/worker.py", 9, "g"))


def _raised(rank, reason="RuntimeError: Sharding propagation failed"):
    return RankResult(0, rank, RankStatus.ERROR, reason=reason, traceback="Traceback ...", raised_in_parallel=True)


# name, end, written, expected causes, expected secondary, expected event kinds
CASES = [
    ("raised on 2-3, 0-1 wait in a collective",
     WorldEnd(EndKind.RANK_EXIT, 1, [None, None, RankExit.BROKEN, RankExit.BROKEN], stacks={0: WAITING, 1: WAITING}),
     {2: _raised(2), 3: _raised(3)}, [2, 3], [0, 1], []),
    ("rank 2 killed by a signal, the rest lose their peer",
     WorldEnd(EndKind.RANK_EXIT, 1, [1, 1, -9, 1]),
     {r: RankResult(0, r, RankStatus.ERROR, reason="RuntimeError: Connection closed by peer") for r in (0, 1, 3)},
     [2], [0, 1, 3], ["signal"]),
    ("rank 1 exits with an error before writing; others stopped",
     WorldEnd(EndKind.RANK_EXIT, 1, [None, 1, None, None], logs={1: "ImportError: boom"}),
     {}, [1], [0, 2, 3], []),
    ("hang: rank 1 stuck where the others are not",
     WorldEnd(EndKind.HANG, 1, [None] * 4, stacks={0: WAITING, 1: COLLECTIVE, 2: WAITING, 3: WAITING}),
     {}, [1], [0, 2, 3], ["hang"]),
    ("hang: everyone in the same frame, no odd one out",
     WorldEnd(EndKind.HANG, 1, [None] * 2, stacks={0: WAITING, 1: WAITING}), {}, [0, 1], [], ["hang"]),
]


@pytest.mark.parametrize("name, end, written, causes, secondary, kinds", CASES, ids=[c[0] for c in CASES])
def test_attribution(name, end, written, causes, secondary, kinds):
    ranks, events = attribute(0, end, dict(written), timeout=30)
    assert [r.rank for r in ranks] == list(range(len(end.codes)))
    assert [r.rank for r in ranks if r.status == RankStatus.ERROR and not r.secondary] == causes
    assert [r.rank for r in ranks if r.secondary] == secondary
    assert [e.kind for e in events] == kinds


def test_waiting_ranks_say_on_whom_and_where():
    end = WorldEnd(EndKind.RANK_EXIT, 1, [None, None, RankExit.BROKEN, RankExit.BROKEN], stacks={0: WAITING, 1: WAITING})
    ranks, _ = attribute(0, end, {2: _raised(2), 3: _raised(3)}, timeout=30)
    assert ranks[0].reason == "was waiting on ranks 2-3 in distributed_c10d.py:4000 in barrier, called from worker.py:9 in g"


def test_signal_reason_names_the_signal():
    ranks, events = attribute(0, WorldEnd(EndKind.RANK_EXIT, 1, [None, -9]), {}, timeout=30)
    assert ranks[1].reason == "rank 1 died by signal SIGKILL" and "SIGKILL" in events[0].message


def test_innermost_skips_torch_frames_for_the_caller():
    assert innermost(COLLECTIVE) == "distributed_c10d.py:3252 in all_reduce, called from specs.py:51 in f"
    assert innermost("") == "an unknown frame (no stack was captured)"


def test_odd_ones_out():
    assert odd_ones_out({0: "a", 1: "b", 2: "a", 3: "a"}) == [1]
    assert odd_ones_out({0: "a", 1: "a"}) == []


@pytest.mark.parametrize("ranks, text", [([0, 1, 2, 5], "0-2,5"), ([3], "3"), ([], ""), ([2, 0, 1], "0-2")])
def test_ranks_text(ranks, text):
    assert ranks_text(ranks) == text
