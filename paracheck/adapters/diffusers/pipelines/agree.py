"""The first-block cache's reuse decision held to one answer across the CP group, so that a case where diffusers'
ranks would part ways ends at once, named, instead of hanging.

diffusers' first-block cache decides on each rank, from the head block's residual as the rank holds it: under context
parallelism, its own shard of the sequence (docs/upstream/fbc_local_decision.md). Where the ranks' change ratios
fall on both sides of the threshold, a rank that reuses skips the remaining blocks while the others run them and wait
for it in their first all-to-all, for ever (Flux's first-block cache at `u8` and `r2xu4`). A hang is the worst a test
kit can give, and no threshold is safe before the run: the ratios are only known as it goes. So on the parallel
pipeline every CP rank gathers each decision (one flag and its ratio, a call) before acting on it, and where they
differ every rank raises `Diverged` together, naming which ranks would compute and which reuse; the known-failures
entry (`fbc_local_decision`) declares it. Where they agree the decision is diffusers' own, unchanged.
"""

from __future__ import annotations

import math

#: The words every `Diverged` starts with (the known-failures entry matches them).
DIVERGED = "the first-block cache decided per rank"


#: What the report says of the guard (`results.report`'s stand-in lines): the kit wraps a library component here.
REPORTED = {"why": "diffusers' first-block cache decides per rank from its own shard under context parallelism, and "
                   "ranks that decide apart hang in the next all-to-all (docs/upstream/fbc_local_decision.md)",
            "kit": ["a check around its decision: each call's decision gathered across the CP group (one all-gather "
                    "a call), the case ended, named, where the ranks differ"],
            "library": ["the first-block cache's hooks and its own decision, used unchanged where the ranks agree"]}


class Diverged(RuntimeError):
    """The CP ranks' first-block cache decisions differ at a call: diffusers would hang in the next collective."""


def guard(pipe, group) -> bool:
    """Hold the first-block cache's decision on `pipe`'s transformer to agreement across `group` (the CP process
    group; None or one rank: nothing to agree, and False)."""
    import torch
    import torch.distributed as dist

    from paracheck.adapters.diffusers import library
    from paracheck.world.regions import once_per_rank

    if group is None or dist.get_world_size(group) < 2:
        return False
    head, _, _ = library.first_block_cache_hooks(pipe.transformer)
    own = head._should_compute_remaining_blocks
    calls = [0]

    def decide(residual, call: int) -> bool:
        previous = head.state_manager.get_state().head_block_residual
        decided = own(residual)
        ratio = math.nan if previous is None else float(library.fbc_change_ratio(residual, previous))
        mine = torch.tensor([float(decided), ratio], device=residual.device)
        ranks = dist.get_process_group_ranks(group)
        every = [mine.clone() for _ in ranks]
        dist.all_gather(every, mine, group=group)
        flags = [bool(t[0]) for t in every]
        if len(set(flags)) > 1:
            raise Diverged(_said(head, call, ranks, flags, [float(t[1]) for t in every]))
        return decided

    def agreed(residual):
        calls[0] += 1
        # Each rank decides on its own shard, then the ranks compare: in a local world once per rank (the ratio,
        # a Python float in diffusers' decision and here, is each rank's own; one for all of them raised inside
        # torch's LocalTensorMode), as N processes do; elsewhere once. The decision returned is the ranks' common one.
        return once_per_rank(lambda: decide(residual, calls[0]))

    head._should_compute_remaining_blocks = agreed
    return True


def _said(head, call: int, ranks: list, flags: list, ratios: list) -> str:
    def side(compute: bool) -> str:
        return ", ".join(f"{rank} ({ratio:.4f})" for rank, flag, ratio in zip(ranks, flags, ratios) if flag == compute)
    context = head.state_manager.context.name
    return (f"{DIVERGED} under context parallelism: at its call {call} ({context!r}), threshold {head.threshold}, "
            f"ranks {side(True)} compute the remaining blocks and ranks {side(False)} reuse them (each rank's change "
            "ratio on its own shard); diffusers would leave the computing ranks waiting in the next all-to-all")
