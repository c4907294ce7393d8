"""The quick tier: a small, deterministic part of a full matrix of cases that still meets every pair that finds bugs.

A bug that needs one layout and one input (a mask under Ulysses, an uneven length under ring) is met by any
case holding that pair, so a pairwise cover keeps the matrix's teeth at a fraction of its cases: every
(model, layout), (model, variant) and (layout kind, variant) pair of the full matrix's plain cases is met at
least once, and so is every extra need the caller names (each declared known failure, so the table keeps
showing it). Each (model, layout) cell gets one case first, its variant chosen greedily for the pairs it still
meets; a pair no cell's choice met adds a case. A case that only re-declares a known failure another case
already shows is not chosen where a case meeting nothing known covers the same pairs. Controls follow their
plain case, and each control keeps one case at least. Pure and torch-free.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Callable, Iterable

Need = tuple
#: (key, predicate): a case meets the need `("known", key)` when the predicate holds for it.
Extra = tuple[str, Callable[[object], bool]]


def layout_kind(name: str) -> str:
    """The kinds of parallelism a layout composes, its degrees left out: tp2xu2 and tp4xu2 are both `tpxu`."""
    return re.sub(r"[0-9]+", "", name)


def needs_of(case, extras: Iterable[Extra] = (), runs: Callable[[object], bool] = lambda case: True) -> frozenset:
    """The needs one plain case meets; a case known to be a skip (`runs` says no) meets its cell alone."""
    lib, layout = case.library, case.layout.name
    if not runs(case):
        return frozenset({("model-layout", lib, case.model, layout)})
    met = {("model-layout", lib, case.model, layout), ("model-variant", lib, case.model, case.variant),
           ("kind-variant", lib, layout_kind(layout), case.variant)}
    met |= {("known", key) for key, holds in extras if holds(case)}
    return frozenset(met)


def quick(cases: list, extras: Iterable[Extra] = (), runs: Callable[[object], bool] = lambda case: True) -> list:
    """The quick tier of `cases` (the full matrix, in its order), in the same order. `runs(case)` is False for a
    case known before it starts to be a skip (a model without the plan a layout needs): it stands in for no pair."""
    extras = list(extras)
    plain = [i for i, c in enumerate(cases) if c.control is None]
    if not plain:
        return list(cases)
    met = {i: needs_of(cases[i], extras, runs) for i in plain}
    todo = set().union(*met.values())
    chosen = _one_per_cell(cases, plain, met, todo)
    while todo:  # a pair no cell's one case could meet: the case meeting most of what is left
        best = min((i for i in plain if i not in chosen), key=lambda i: _rank(i, met, todo))
        chosen.add(best)
        todo -= met[best]
    chosen = _prune(cases, chosen, met)
    return [cases[i] for i in sorted(chosen | _controls(cases, chosen))]


def _prune(cases: list, chosen: set[int], met: dict) -> set[int]:
    """Drop each case another in its cell makes redundant (a cell's first pick, once an extra case meets its
    needs too), known-failure cases first: what is left is each cell's one case or a case some need requires."""
    def cell(i):
        return cases[i].library, cases[i].model, cases[i].layout.name

    kept = set(chosen)
    for i in sorted(chosen, key=lambda i: (-sum(n[0] == "known" for n in met[i]), -i)):
        rest = kept - {i}
        if any(cell(j) == cell(i) for j in rest) and met[i] <= set().union(*(met[j] for j in rest)):
            kept = rest
    return kept


def _one_per_cell(cases: list, plain: list[int], met: dict, todo: set) -> set[int]:
    cells: dict[tuple, list[int]] = {}
    for i in plain:
        c = cases[i]
        cells.setdefault((c.library, c.model, c.layout.name), []).append(i)
    chosen: set[int] = set()
    while cells:
        cell, best = min(((cell, min(options, key=lambda i: _rank(i, met, todo))) for cell, options in cells.items()),
                         key=lambda pair: _rank(pair[1], met, todo))
        chosen.add(best)
        todo -= met[best]
        del cells[cell]
    return chosen


def _rank(i: int, met: dict, todo: set) -> tuple:
    """Smaller is better: most needs still open, then the fewest known failures met (a case that declares one
    again shows nothing new), then the matrix's own order."""
    known = sum(1 for need in met[i] if need[0] == "known")
    return (-len(met[i] & todo), known, i)


def _controls(cases: list, chosen: set[int]) -> set[int]:
    """The control cases whose plain case was chosen, and the first case of each control that got none."""
    twins = {cases[i].plain for i in chosen}
    picked = {i for i, c in enumerate(cases) if c.control is not None and c.plain in twins}
    named = {cases[i].control for i in picked}
    for i, c in enumerate(cases):
        if c.control is not None and c.control not in named:
            picked.add(i)
            named.add(c.control)
    return picked


def layout_parts(name: str) -> frozenset[str]:
    """The kinds of parallelism a layout name composes, one by one: tp2xfsdp2 -> {tp, fsdp}."""
    return frozenset(part for part in layout_kind(name).split("x") if part)


def with_training(cases: list, steps: int, checkpoint: bool, everything: bool = False,
                  needs: Callable[[object], bool] = lambda case: False,
                  runs: Callable[[object], bool] = lambda case: True,
                  parts: Callable[[object], frozenset] = lambda case: layout_parts(case.layout.name)) -> list:
    """`cases` with `parity.steps` (`steps` optimizer steps) and `checkpoint.roundtrip` turned on where they run
    (`turned_on`; `parts`: what a case's training covers, its layout's kinds by default, and an adapter may add
    their compositions)."""
    return turned_on(cases, dict(steps=steps, checkpoint=checkpoint), everything, needs, runs, parts=parts)


def with_generate(cases: list, everything: bool = False, needs: Callable[[object], bool] = lambda case: False,
                  runs: Callable[[object], bool] = lambda case: True,
                  generates: Callable[[object], bool] = lambda case: True) -> list:
    """`cases` with `parity.generate` turned on where it runs (`turned_on`), on the cases whose model `generates`."""
    return turned_on(cases, dict(generate=True), everything, needs, runs, generates)


def turned_on(cases: list, on: dict, everything: bool = False, needs: Callable[[object], bool] = lambda case: False,
              runs: Callable[[object], bool] = lambda case: True,
              eligible: Callable[[object], bool] = lambda case: True,
              parts: Callable[[object], frozenset] = lambda case: layout_parts(case.layout.name)) -> list:
    """`cases` with the fields `on` set (a later pass: the steps, the save, generation) where they run: every plain
    case that is `eligible` with `everything`, else one per part of parallelism per library (the first case, in the
    matrix's order, of the simplest layout holding a part no chosen case holds yet: tp4 before tp2xfsdp2; `parts`
    names a case's parts, its layout's kinds by default). A control case follows its plain case. A control that
    `needs` the pass (its bug shows there only) runs where its plain case has it, else once, on its first case,
    with its plain case turned on too."""
    plain = [c for c in cases if c.control is None and eligible(c)]
    chosen = {c.plain for c in plain} if everything else _kind_cover(plain, runs, parts)
    kept, orphans = [], {}
    for c in cases:
        if c.control is not None and needs(c) and c.plain not in chosen:
            first = orphans.get((c.library, c.control))
            if first is None or (runs(c) and not runs(first)):  # the first case that will run
                orphans[(c.library, c.control)] = c
            continue
        kept.append(c)
    for c in orphans.values():
        # Kept only where it will be a skip (a model that cannot carry it) is not run: it runs on its orphan too.
        if not any(k.control == c.control and k.library == c.library and runs(k) for k in kept):
            chosen.add(c.plain)
            kept.append(c)
    return [replace(c, **on) if c.plain in chosen and (c.control is None or needs(c)) else c
            for c in _in_order(cases, kept)]


def training_parts(case) -> frozenset:
    """What a case's training covers when the tier picks the layouts that train: its adapter's answer
    (`Adapter.training_parts`, declared in `domain.adapter.ADAPTER`; the torch adapter adds each pair of kinds, so a
    TP x FSDP plan's training is met), else its layout's kinds."""
    from paracheck.domain import registry

    own = registry.adapter(case.library).training_parts(case)
    return layout_parts(case.layout.name) if own is None else own


def needs_training(case) -> bool:
    """A control case whose bug only the steps or a save show (`Control.shows_in_training`)."""
    from paracheck.domain import registry

    return bool(case.control) and registry.get_control(case.control).shows_in_training


def needs_generate(case) -> bool:
    """A control case whose bug only generation shows (`Control.shows_in_generate`)."""
    from paracheck.domain import registry

    return bool(case.control) and registry.get_control(case.control).shows_in_generate


def _kind_cover(plain: list, runs, parts) -> set:
    covered: set = set()
    chosen = set()
    order = sorted(range(len(plain)), key=lambda i: (len(layout_parts(plain[i].layout.name)), i))
    for i in order:
        c = plain[i]
        held = {(c.library, part) for part in parts(c)}
        if runs(c) and held - covered:
            covered |= held
            chosen.add(c.plain)
    return chosen


def composed_parts(name: str) -> frozenset:
    """A layout's kinds and each pair of them it composes (pure): tp2xfsdp2 -> {tp, fsdp, fsdp+tp}. Training
    covered by these meets what only a composition shows (TP's and FSDP's reductions of one gradient)."""
    kinds = sorted(layout_parts(name))
    return frozenset(kinds) | {f"{a}+{b}" for i, a in enumerate(kinds) for b in kinds[i + 1:]}


def _in_order(cases: list, kept: list) -> list:
    ids = {id(c) for c in kept}
    return [c for c in cases if id(c) in ids]
