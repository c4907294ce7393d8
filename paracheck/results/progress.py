"""Progress while a run goes: a line per finished case, and on a terminal a bar with what runs next."""

from __future__ import annotations

import sys
import time

from paracheck.results import report
from paracheck.results.verdict import judge


class Progress:
    def __init__(self, cases, quiet: bool = False, out=None, bar=None, entries=()):
        self.cases, self.quiet, self.entries = cases, quiet, list(entries)
        self.out = out or sys.stdout
        self.bar = bar if bar is not None else (sys.stderr if sys.stderr.isatty() and not quiet else None)
        self.done, self.failing, self.started = 0, 0, time.time()
        self.plain = {}  # plain verdicts so far, so a control's line can say inconclusive
        self.verdicts: dict = {}  # index -> the case's verdict, judged once, when it finished

    def case_done(self, index: int, ranks) -> None:
        [verdict] = judge([self.cases[index]], [ranks], self.entries, self.plain)
        self.verdicts[index] = verdict
        self.done += 1
        self.failing += verdict.status.failing
        if not self.quiet:
            self._clear()
            print(report.progress_line(verdict, self.done, len(self.cases)), file=self.out, flush=True)
        self._draw(index)

    def _draw(self, index: int) -> None:
        if self.bar is None:
            return
        total, elapsed = len(self.cases), time.time() - self.started
        left = elapsed / self.done * (total - self.done) if self.done else 0.0
        width = 24
        filled = int(width * self.done / max(total, 1))
        following = self.cases[index + 1].id if index + 1 < total else "-"
        self.bar.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{total}  {self.failing} failing  "
                       f"~{left:.0f}s left  next: {following}\x1b[K")
        self.bar.flush()

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
