"""`parity.generate`'s rule: a greedy generation held to the single-device one, row by row and decode step by step.

Library-neutral. A `Generation` is what one greedy `generate` call gives: the sequences and the raw logits of every
new token. Each row is its own sequence, compared step by step until it is over or the two runs part:

- tokens equal, logits within the tolerance (`|a - e| <= atol + rtol * |e|` elementwise): the step agrees;
- tokens equal, logits beyond it: the row fails at this step;
- tokens differ: a tie when the logits still agree within the tolerance and each run's token is among the other's
  `TOP_K` best (greedy picked between two near-equal scores, which any change in summation order may flip: in
  reduced precision, at the precision's rounding); the row is compared up to this step and no further (the runs now
  condition on different text). Otherwise the row fails at this step.

The same rule serves every dtype: what moves with the precision is the tolerance (`checks.compare.tolerance`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from paracheck.domain.records import CheckId, CheckResult, Status

#: A flip is a tie only when each run's token is among the other's best TOP_K (greedy chose between the top two).
TOP_K = 2


@dataclass
class Generation:
    """One greedy generation: `tokens` [rows, prompt + new] and `logits` [new, rows, vocab] (before any logits
    processor)."""
    tokens: torch.Tensor
    logits: torch.Tensor

    @property
    def new(self) -> int:
        return self.logits.shape[0]

    def rows(self, start: int, stop: int) -> "Generation":
        return Generation(self.tokens[start:stop], self.logits[:, start:stop])


@dataclass
class Parting:
    """Where one row of the two runs parted: its decode `step` (0: the prompt's forward), the `kind` ("logits":
    tokens equal, logits beyond the tolerance; "token": tokens differ beyond a tie; "tie": tokens differ within
    one), and the figures at that step."""
    row: int
    step: int
    kind: str
    max_abs: float
    tokens: tuple[int, int]

    def describe(self) -> str:
        mine, ref = self.tokens
        what = {"logits": f"logits differ by {self.max_abs:.2e} (tokens agree: {ref})",
                "token": f"token {mine} where the reference has {ref} (logits differ by {self.max_abs:.2e})",
                "tie": f"a tie: token {mine} for {ref}, logits within the tolerance ({self.max_abs:.2e})"}[self.kind]
        return f"row {self.row}, decode step {self.step}: {what}"


@dataclass
class Held:
    """Two generations held row by row: the per-step largest difference over the rows still compared, the rows that
    failed (`failing`, by step) and the ties that ended a row's comparison."""
    steps: list[float] = field(default_factory=list)
    failing: list[Parting] = field(default_factory=list)
    ties: list[Parting] = field(default_factory=list)
    problem: str = ""

    @property
    def ok(self) -> bool:
        return not self.problem and not self.failing

    @property
    def first(self) -> Parting | None:
        return min(self.failing, key=lambda p: (p.step, p.row)) if self.failing else None


def hold(actual: Generation, expected: Generation, atol: float, rtol: float, k: int = TOP_K) -> Held:
    """`actual` held to `expected` by the module's rule."""
    if actual.tokens.shape != expected.tokens.shape or actual.logits.shape != expected.logits.shape:
        return Held(problem=f"shapes: tokens {tuple(actual.tokens.shape)}, logits {tuple(actual.logits.shape)} where "
                            f"the reference has {tuple(expected.tokens.shape)}, {tuple(expected.logits.shape)}")
    prompt = actual.tokens.shape[1] - actual.new
    if not torch.equal(actual.tokens[:, :prompt], expected.tokens[:, :prompt]):
        return Held(problem="the returned sequences do not start with the same prompt")
    a, e = actual.logits.detach().double().cpu(), expected.logits.detach().double().cpu()
    if not torch.isfinite(a).all():
        return Held(problem="non-finite logits")
    diff = (a - e).abs()
    within = (diff <= atol + rtol * e.abs()).all(dim=-1)  # [steps, rows]
    held, live = Held(), [True] * a.shape[1]
    for step in range(a.shape[0]):
        rows = [r for r in range(a.shape[1]) if live[r]]
        held.steps.append(float(diff[step, rows].max()) if rows else 0.0)
        for row in rows:
            parting = _at(step, row, actual.tokens[row, prompt + step], expected.tokens[row, prompt + step],
                          a[step, row], e[step, row], bool(within[step, row]), k)
            if parting is not None:
                live[row] = False
                (held.ties if parting.kind == "tie" else held.failing).append(parting)
    return held


def _at(step: int, row: int, mine, ref, logits, ref_logits, within: bool, k: int) -> Parting | None:
    mine, ref = int(mine), int(ref)
    max_abs = float((logits - ref_logits).abs().max())
    if mine == ref:
        return None if within else Parting(row, step, "logits", max_abs, (mine, ref))
    tie = within and mine in _top(ref_logits, k) and ref in _top(logits, k)
    return Parting(row, step, "tie" if tie else "token", max_abs, (mine, ref))


def _top(logits, k: int) -> set[int]:
    return set(torch.topk(logits, min(k, logits.numel())).indices.tolist())


def check(held: dict[str, Held], atol: float, rtol: float, notes: dict[str, str] | None = None) -> CheckResult:
    """`parity.generate` over every mode a case generated in (`held`: mode -> `Held`; `notes`: mode -> why it did not
    run). Data: per mode, each step's largest difference, where it first parted, the ties."""
    data = {"modes": {mode: _data(h) for mode, h in held.items()}}
    facets = {mode: h.ok for mode, h in held.items()}
    if notes:
        data["not_run"] = dict(notes)
    worst = max((max(h.steps, default=0.0) for h in held.values()), default=0.0)
    bad = [(mode, h) for mode, h in held.items() if not h.ok]
    if not held:
        return CheckResult(CheckId.GENERATE, Status.SKIP, "; ".join(f"{m}: {w}" for m, w in (notes or {}).items()),
                           data=data)
    if not bad:
        return CheckResult(CheckId.GENERATE, Status.PASS, "", worst, None, atol, rtol, data=data, facets=facets)
    firsts = [(h.first.step if h.first else -1, mode, h) for mode, h in bad]
    step, mode, h = min(firsts, key=lambda item: item[0])
    data["first_step"] = step
    detail = f"{mode}: " + (h.problem or h.first.describe())
    more = len(h.failing) - 1 + sum(len(other.failing) for m, other in bad if m != mode)
    return CheckResult(CheckId.GENERATE, Status.FAIL, detail + (f" (+{more} more rows)" if more > 0 else ""), worst,
                       None, atol, rtol, data=data, facets=facets)


def _data(held: Held) -> dict:
    return {"steps": held.steps, "first": _parting(held.first), "ties": [_parting(t) for t in held.ties],
            "problem": held.problem or None}


def _parting(parting: Parting | None) -> dict | None:
    if parting is None:
        return None
    return {"row": parting.row, "step": parting.step, "kind": parting.kind, "max_abs": parting.max_abs,
            "tokens": list(parting.tokens)}
