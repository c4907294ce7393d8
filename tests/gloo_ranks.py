"""A test's own forked ranks (`paracheck.rank.forked.fork_ranks`): each joins one gloo world over a file store, and
hands its findings back to the test as JSON, one file a rank."""

import contextlib
import json
import os


@contextlib.contextmanager
def gloo_world(rank: int, world: int, tmp: str):
    """This rank in a `world`-rank gloo world stored in `tmp`; left with a barrier first, so no rank tears gloo
    down while a peer is still in a collective (not on a raise: the peers may never reach it)."""
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), world), rank=rank,
                            world_size=world)
    yield
    dist.barrier()
    dist.destroy_process_group()


def answer(tmp: str, rank: int, found) -> None:
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as handle:
        json.dump(found, handle)


def answers(tmp: str, world: int) -> list:
    """Every rank's answer, by rank."""
    out = []
    for rank in range(world):
        with open(os.path.join(tmp, f"rank{rank}.json")) as handle:
            out.append(json.load(handle))
    return out
