"""Progress while a run goes: a line per finished case; on a terminal a bar with the cases done and left,
the time left and what runs next; elsewhere (CI logs, --quiet) a plain line now and then saying the same."""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass, field

from paracheck.results import report
from paracheck.results.verdict import judge

#: A run shorter than this shows no progress line: its table comes soon enough.
QUIET_FOR = 5.0
#: Without a bar, a progress line at least this often (seconds), when a case finishes...
EVERY_SECONDS = 30.0
#: ...and each time this share of the cases more is done.
EVERY_SHARE = 0.1


@dataclass
class Estimate:
    """Seconds left, from the pace since the first case finished (the first pays for starting the world and
    its first references, which the cases after it mostly do not). Where the cases left are known, each is
    priced by the cases of its kind done so far (`kinds_of`: its model, and whether it trains), so a run whose
    slow cases come last (transformers' training and saves after the diffusers cases, Helios after Flux) is not
    promised their end at the fast cases' pace; the sum is scaled by how the wall clock ran against the cases'
    own seconds."""
    first_done: float | None = None
    seconds: dict = field(default_factory=dict)  # kind -> [case-seconds summed, cases]
    counted: float = 0.0  # case-seconds of the cases after the first

    def learn(self, case, seconds: float, first: bool) -> None:
        for kind in kinds_of(case):
            total = self.seconds.setdefault(kind, [0.0, 0])
            total[0] += seconds
            total[1] += 1
        if not first:
            self.counted += seconds

    def left(self, done: int, total: int, now: float, started: float, remaining: dict | None = None) -> float | None:
        """`remaining`: the cases left, counted by their kinds (`kinds_of(case)`)."""
        if done == 1 and self.first_done is None:
            self.first_done = now
        if done == 0:
            return None
        if done == 1 or self.first_done is None or now <= self.first_done:
            return (now - started) * (total - done) / done
        pace = (now - self.first_done) / (done - 1)
        if not remaining or self.counted <= 0:
            return pace * (total - done)
        scale = (now - self.first_done) / self.counted
        return scale * sum(count * self._priced(kinds) for kinds, count in remaining.items() if count)

    def _priced(self, kinds: tuple) -> float:
        """The mean case-seconds of the most specific of `kinds` seen so far."""
        summed, count = next((self.seconds[k] for k in kinds if k in self.seconds), (0.0, 1))
        return summed / count


def kinds_of(case) -> tuple:
    """A case's kinds (a `Case`'s), from the most specific to any case: (library, model, trains), (library, trains),
    ()."""
    trains = bool(case.steps or case.checkpoint)
    return (case.library, case.model, trains), (case.library, trains), ()


def duration(seconds: float | None) -> str:
    """`~42s`, `~3m05s`, `~1h12m`; `?` before anything is known."""
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"~{seconds}s"
    if seconds < 3600:
        return f"~{seconds // 60}m{seconds % 60:02d}s"
    return f"~{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    def __init__(self, cases, quiet: bool = False, out=None, bar=None, entries=(), log=None, clock=time.time):
        self.cases, self.quiet, self.entries = cases, quiet, list(entries)
        self.out = out or sys.stdout
        self.bar = bar if bar is not None else (sys.stderr if sys.stderr.isatty() and not quiet else None)
        # No bar (a CI log, a pipe, --quiet): a plain line now and then instead, on stderr beside the rest.
        self.log = None if self.bar is not None else (log or sys.stderr)
        self.clock = clock
        self.done, self.failing, self.started = 0, 0, clock()
        self.estimate, self.logged_at, self.logged_done = Estimate(), self.started, 0
        self.plain = {}  # plain verdicts so far, so a control's line can say inconclusive
        self.verdicts: dict = {}  # index -> the case's verdict, judged once, when it finished
        self.remaining = Counter(kinds_of(c) for c in cases)  # the cases not done, by their kinds

    def case_done(self, index: int, ranks) -> None:
        [verdict] = judge([self.cases[index]], [ranks], self.entries, self.plain)
        self.verdicts[index] = verdict
        self.done += 1
        self.failing += verdict.status.failing
        if not self.quiet:
            self._clear()
            print(report.progress_line(verdict, self.done, len(self.cases)), file=self.out, flush=True)
        now = self.clock()
        self.estimate.learn(self.cases[index], verdict.seconds, first=self.done == 1)
        self.remaining[kinds_of(self.cases[index])] -= 1
        left = self.estimate.left(self.done, len(self.cases), now, self.started, self.remaining)
        self._draw(index, left)
        self._log(now, left)

    def _draw(self, index: int, left: float | None) -> None:
        if self.bar is None:
            return
        total = len(self.cases)
        width = 24
        filled = int(width * self.done / max(total, 1))
        following = self.cases[index + 1].id if index + 1 < total else "-"
        self.bar.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{total}, {total - self.done} left, "
                       f"{duration(left)} to go  {self.failing} failing  next: {following}\x1b[K")
        self.bar.flush()

    def _log(self, now: float, left: float | None) -> None:
        total = len(self.cases)
        if self.log is None or now - self.started < QUIET_FOR or self.done == total:
            return
        share = (self.done - self.logged_done) / max(total, 1)
        if now - self.logged_at < EVERY_SECONDS and share < EVERY_SHARE:
            return
        self.logged_at, self.logged_done = now, self.done
        print(progress_text(self.done, total, self.failing, now - self.started, left), file=self.log, flush=True)

    def _clear(self) -> None:
        if self.bar is not None:
            self.bar.write("\r\x1b[K")
            self.bar.flush()

    def judged(self, results: list) -> list:
        """Every case's verdict in order: the one judged when it finished, or (a case never handed over) now."""
        missing = [i for i in range(len(self.cases)) if i not in self.verdicts]
        late = judge([self.cases[i] for i in missing], [results[i] for i in missing], self.entries, self.plain)
        self.verdicts.update(zip(missing, late))
        return [self.verdicts[i] for i in range(len(self.cases))]

    def close(self) -> None:
        self._clear()


def progress_text(done: int, total: int, failing: int, elapsed: float, left: float | None) -> str:
    return (f"paracheck: {done}/{total} cases done, {total - done} left, {failing} failing, "
            f"{duration(elapsed)[1:]} so far, {duration(left)} left")
