"""`paracheck explore`: hypothesis draws cases, one fed world runs them, each new failure is shrunk and kept.

A drawn case is a model, a layout, an input `Shape` (batch, lengths, masks, timesteps; for token rows the
padding side and packed documents), a dtype and library options, within the model's `Space`. Each draw is
judged by its adapter's explore face (`Adapter.explore_case`), which rejects what cannot run, so no rank spends
time on it. A failure is identified by its
*signature* (model class, failing checks, the error with its numbers blanked); one hypothesis run hunts
one new signature and shrinks it, then the next run hunts the next, until the example budget is spent.
Failures a known-failures entry explains are counted, not hunted.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from hypothesis import HealthCheck, Phase, Verbosity, given, reject, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.errors import Flaky, Unsatisfiable

from paracheck.domain import registry
from paracheck.domain.case import Case
from paracheck.explore.found import Found
from paracheck.domain.layout import Layout
from paracheck.domain.records import CaseStatus, Failure, FailureKind
from paracheck.domain.shapes import PAD_SIDES, TOKENS, Shape, Space
from paracheck.results.verdict import Verdict, judge

#: New cases one hunt may run while shrinking its failure (after that, untried shapes count as passing).
SHRINK_BUDGET = 60


@dataclass(frozen=True)
class Target:
    """A model explore may draw: its name and factory, its shape space, the layouts it has a plan for, and
    whose model it is (a layout is then that library's, e.g. a transformers `TfLayout`)."""
    name: str
    factory: str
    space: Space
    layouts: tuple[Layout, ...]
    library: str
    #: (draw, layout, uneven) -> [(name, value)]: the library options a draw adds (its adapter's `draw_options`).
    draw_options: Callable = lambda draw, layout, uneven: []


@dataclass(frozen=True)
class Draw:
    target: Target
    layout: Layout
    shape: Shape
    uneven: bool
    options: tuple
    dtype: str


def draws(targets: list[Target], dtypes: list[str]) -> st.SearchStrategy:
    """Cases as hypothesis draws them; every choice shrinks towards the plainest (first model and layout,
    batch 1, shortest lengths, no mask, distinct timesteps, even lengths, default options, first dtype)."""

    @st.composite
    def draw(d) -> Draw:
        target = d(st.sampled_from(targets))
        layout = d(st.sampled_from(target.layouts))
        space = target.space
        if space.token_rows:
            return Draw(target, layout, d(token_rows(space, layout.dp)), False, (), d(st.sampled_from(dtypes)))
        batch = d(st.integers(1, space.batch))
        lengths = {axis: d(st.sampled_from(spec.values)) for axis, spec in space.axes.items()}
        padded = ()
        if space.masks and d(sometimes(3)):  # a mask fails some forwards first and hides their grads
            padded = tuple(d(st.lists(st.integers(0, 8), min_size=batch, max_size=batch)))
        shared = batch > 1 and space.timesteps and d(st.booleans())
        uneven = d(sometimes(3))
        options = target.draw_options(d, layout, uneven)
        shape = Shape(batch, tuple(lengths.items()), padded=padded, shared_timestep=shared)
        return Draw(target, layout, shape, uneven, tuple(sorted(options)), d(st.sampled_from(dtypes)))

    return draw()


def token_rows(space: Space, dp: int) -> st.SearchStrategy:
    """Shapes of token rows: a batch `dp` divides (at least `dp` rows), a length, and one draw in
    three each padded rows (a count per row that leaves a token, on either side) or packed rows (each split
    into up to four documents); shrinks to `dp` rows, the shortest length, no padding, the right side."""

    @st.composite
    def rows(d) -> Shape:
        batch = dp * d(st.integers(1, max(1, space.batch // dp)))
        length = d(st.sampled_from(space.axes[TOKENS].values))
        lengths = ((TOKENS, length),)
        kind = d(st.sampled_from(["plain", "padded", "packed"] if space.masks else ["plain", "packed"]))
        if kind == "padded":
            padded = d(st.lists(st.integers(0, length - 1), min_size=batch, max_size=batch))
            return Shape(batch, lengths, padded=padded, pad_side=d(st.sampled_from(PAD_SIDES)),
                         token_rows=True)
        if kind == "packed":
            cuts = st.lists(st.integers(1, length - 1), max_size=3, unique=True) if length > 1 else st.just([])
            documents = [_documents(sorted(d(cuts)), length) for _ in range(batch)]
            return Shape(batch, lengths, documents=documents, token_rows=True)
        return Shape(batch, lengths, token_rows=True)

    return rows()


def _documents(cuts: list[int], length: int) -> tuple[int, ...]:
    """A row of `length` cut at `cuts` -> the lengths of its documents."""
    edges = [0, *cuts, length]
    return tuple(b - a for a, b in zip(edges, edges[1:]))


def sometimes(one_in: int) -> st.SearchStrategy:
    """True once in `one_in` draws; shrinks to False."""
    return st.integers(0, one_in - 1).map(lambda n: n == one_in - 1)


def probe(draw: Draw, attention_backend: str = "auto") -> Case | None:
    """The case to run for `draw`, or None when it cannot run: its adapter's explore face judges it (the launcher
    asks, not the ranks)."""
    t = draw.target
    extras = {"uneven": draw.uneven, "options": draw.options, "attention_backend": attention_backend}
    try:
        return registry.adapter(t.library).explore_case(t.name, t.factory, t.space, draw.layout, draw.shape,
                                                        draw.dtype, extras)
    except ValueError:
        return None


def signature(verdict: Verdict) -> str | None:
    """How a case failed, None when it did not: the model class and the failure's typed identity (the first
    failing check, the exception's type and where it was raised; for wrong numbers, the kinds of
    parallelism). Built from `Verdict.failure`, never from a message, so rewording one changes nothing.
    The first symptom names a bug: a case that also trips a second, known one still shrinks to this one."""
    if verdict.status not in (CaseStatus.FAIL, CaseStatus.ERROR):
        return None
    f = verdict.failure or Failure(FailureKind.EXIT)
    what = f.check.value if f.check else "error"
    if f.kind == FailureKind.CHECK:
        message = "wrong under " + "+".join(verdict.case.layout.kinds)
    elif f.kind == FailureKind.RAISE:
        message = f"{f.exception} in {f.site or 'an unknown frame'}"
        if f.entry_point:
            message += f" (inside the library's {f.entry_point})"
    elif f.kind == FailureKind.HANG:
        message = f"hung in {f.site or 'an unknown frame'}"
    elif f.kind == FailureKind.EXIT:
        message = f"a rank ended by {f.exception or 'an unknown cause'}"
    else:
        message = f.key
    return f"{verdict.model_class or verdict.case.model} {what}: {message}"


class _Failing(Exception):
    """Raised inside a hunt for the signature it hunts; hypothesis shrinks the draw that raised it."""


@dataclass
class Explorer:
    """Runs cases through a fed world (`launch.Feeder`), remembers every verdict, and hunts failures."""
    feeder: object
    entries: list
    attention_backend: str = "auto"
    on_case: object = None
    found: dict[str, Found] = field(default_factory=dict)
    known_hits: Counter = field(default_factory=Counter)
    #: Cases run, by status (a run whose every draw is skipped found nothing because it tested nothing).
    statuses: Counter = field(default_factory=Counter)
    events: list = field(default_factory=list)
    ran: int = 0
    _seen: dict[str, Verdict] = field(default_factory=dict)

    def judged(self, case: Case, new_allowed: bool = True) -> Verdict | None:
        """`case`'s verdict, run the first time it is asked for (None when it is new and `new_allowed` is not)."""
        key = json.dumps(case.to_json(), sort_keys=True)
        if key not in self._seen:
            if not new_allowed:
                return None
            results, events = self.feeder.run(case)
            self.events += events
            [verdict] = judge([case], [results], self.entries)
            if verdict.status == CaseStatus.XFAIL:
                self.known_hits[verdict.known] += 1
            self.statuses[verdict.status.value] += 1
            self._seen[key], self.ran = verdict, self.ran + 1
            if self.on_case:
                self.on_case(verdict, self)
        return self._seen[key]

    def replay(self, earlier: list[Found]) -> None:
        """Cases found by earlier runs go first; the ones still failing the same way are found again."""
        for f in earlier:
            v = self.judged(f.case)
            if signature(v) == f.signature:
                self.found[f.signature] = f

    def hunt(self, strategy, seed: int, examples: int) -> int:
        """One hypothesis run for one new failure; returns the new cases it ran before finding one."""
        state = {"target": None, "last": None, "generated": 0, "shrinking": 0}

        @settings(max_examples=max(1, examples), database=None, deadline=None,
                  suppress_health_check=list(HealthCheck), phases=(Phase.generate, Phase.shrink),
                  report_multiple_bugs=False, verbosity=Verbosity.quiet, print_blob=False)
        @hypothesis_seed(seed)
        @given(strategy)
        def attempt(draw: Draw) -> None:
            case = probe(draw, self.attention_backend)
            if case is None:
                reject()
            before = self.ran
            shrinking = state["target"] is not None
            verdict = self.judged(case, new_allowed=not shrinking or state["shrinking"] < SHRINK_BUDGET)
            state["shrinking" if shrinking else "generated"] += self.ran - before
            if verdict is None:
                return
            if verdict.status == CaseStatus.SKIP:
                reject()
            sig = signature(verdict)
            if sig is None or sig in self.found:
                return
            state["target"] = state["target"] or sig
            if sig == state["target"]:
                state["last"] = (case, verdict)
                raise _Failing(sig)

        try:
            attempt()
        except (_Failing, Flaky):
            case, verdict = state["last"]
            self.found[state["target"]] = Found(case, state["target"], _detail(verdict))
        except Unsatisfiable:
            pass
        return state["generated"]


def _detail(verdict: Verdict) -> str:
    failing = [c for c in verdict.checks if c.id in verdict.failing_checks]
    text = verdict.reason if verdict.status == CaseStatus.ERROR or not failing else f"{failing[0].id.value}: {failing[0].detail}"
    return text.splitlines()[0][:300] if text else ""


def run(explorer: Explorer, strategy, seed: int, examples: int, earlier: list[Found]) -> float:
    """Earlier finds first, then hunts until `examples` new cases were generated; returns the seconds."""
    started = time.time()
    explorer.replay(earlier)
    left, hunt = examples, 0
    while left > 0:
        count = len(explorer.found)
        left -= explorer.hunt(strategy, seed + hunt, left)
        hunt += 1
        if len(explorer.found) == count:
            break  # hypothesis ran its examples without a new failure
    return time.time() - started
