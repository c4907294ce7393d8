"""diffusers layouts: `tp2xu2`-style names over tensor, ring and Ulysses parallelism, and the rules they imply.

Torch-free. A name writes its parts in the order tp, r (ring), u (Ulysses), each at most once. Ring and Ulysses are
the two kinds of context parallelism (`layout.cp` is ring x ulysses). The mesh order is the run's `--order`:
cp-fastest lays the mesh out (tp, ring, ulysses), tp-fastest (ring, ulysses, tp); every dimension stays in the mesh,
degree 1 included, as diffusers' own configs build it.
"""

from __future__ import annotations

from paracheck.domain.backends import Backend, neuron_alltoall_takes
from paracheck.domain.layout import ORDERS, Grammar, Layout, LayoutError

#: Names of the parallel dimensions, in the order layouts are written.
DIM_NAMES = ("tp", "ring", "ulysses")
#: The context-parallel dimensions, as diffusers' CP mesh names them.
CP_DIMS = ("ring", "ulysses")

#: The grammar: `DiffusersLayout(tp=2, ulysses=2)` (or positionally, the order last) and `DiffusersLayout.parse`.
DiffusersLayout = Grammar(
    library="diffusers", dims=DIM_NAMES, tokens=("tp", "r", "u"), kind=("tp", "cp", "cp"), named=DIM_NAMES,
    meshes=((ORDERS[0], ("tp", "ring", "ulysses")), (ORDERS[1], ("ring", "ulysses", "tp"))),
    factors=("tp", "cp", "ring", "ulysses"), example="tp2xu2", error=LayoutError, ordered=True)


def layouts_for(world: int, order: str = "cp-fastest") -> list[Layout]:
    """Every layout whose world size is `world`, single-kind ones first."""
    return [layout.with_order(order) for layout in DiffusersLayout.layouts_for(world)]


def parse_layouts(text: str, world: int, order: str = "cp-fastest",
                  flags: tuple[str, str] = ("--layouts", "--nproc")) -> list[Layout]:
    """`all` or a comma list, each named once; every layout must have world size `world`. `flags`: the command's
    names for the layouts and the world size (`topology` says --layout and --world), which an error names."""
    if text.strip() == "all":
        return layouts_for(world, order)
    layouts, (names, size) = [], flags
    for item in text.split(","):
        layout = DiffusersLayout.parse(item, order)
        if layout.world != world:
            raise LayoutError(
                f"{names} {layout.name}: its world size is {layout.world} "
                f"({' x '.join(str(d) for d in layout.degrees.values() if d > 1)}), "
                f"but {size} is {world}; the product of the degrees must equal {size}"
            )
        if layout not in layouts:
            layouts.append(layout)
    return layouts


def head_multiple(layout: Layout) -> int:
    """Heads must be a multiple of this: TP splits heads, then Ulysses splits each rank's heads."""
    return layout.tp * layout.ulysses


def fit_heads(heads: int, layout: Layout) -> int:
    """The smallest head count >= `heads` that tp x ulysses divides."""
    multiple = head_multiple(layout)
    return -(-heads // multiple) * multiple


def heads_unfit(heads: int, layout: Layout, nearest: int | None = None) -> str:
    """The sentence for `heads` heads that tp x ulysses does not divide, naming the nearest fit (`fit_heads`'s,
    unless the caller's fitting chose `nearest`)."""
    nearest = fit_heads(heads, layout) if nearest is None else nearest
    return f"{heads} heads: tp x ulysses = {head_multiple(layout)} must divide them (nearest fit: {nearest})"


def backend_problems(backend: Backend, layout: Layout) -> list[str]:
    """Why `backend` cannot run `layout`; empty when it can (Neuron's all-to-all, which Ulysses issues, takes only
    contiguous groups of some sizes)."""
    found = []
    if backend.name == "neuron" and layout.ulysses > 1:
        u = layout.ulysses
        if not neuron_alltoall_takes(u):
            found.append(
                f"ulysses degree {u}: Neuron's all-to-all takes groups of 4, 8, 16 or a multiple of 32"
            )
        if layout.has_tp and layout.order == "tp-fastest":
            found.append(
                "--order tp-fastest makes Ulysses groups strided, and Neuron's all-to-all only accepts "
                "contiguous replica groups; use --order cp-fastest"
            )
    return found
