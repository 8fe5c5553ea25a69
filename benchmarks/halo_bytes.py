"""Bytes moved by ``halo_exchange`` against the lower bound computed from the layout.

A float32 ``(B, C, H, W) = (2, 3, 131, 64)`` field on 4 ranks, as a slab (H split 40/33/30/28
over a 1-D mesh, halos along H) and as a 2x2 block decomposition (H 70/61 over mesh axis 0,
W 36/28 over axis 1, halos along H and W: faces, edges and corners), with halo widths 1 and 2
and ``periodic`` and ``zeros`` boundaries. Each rank counts its bytes with
``shardsci.testing.count_traffic`` (the point-to-point messages torch sends and receives,
independently of the library's own count) and the benchmark computes, from the layout alone, the least each rank must receive: the distinct cells of its halo region
(its shard grown by the width along each halo dim, cells beyond a ``zeros`` boundary excluded,
periodic indices wrapped) that it does not own. The backward pass (the halo adjoint) must send
every halo cell's gradient back to its owner: each rank receives, at least, gradients for the
cells it sent in the forward pass. The extended shards are also checked against ``F.pad`` of
the whole field. Goal: every case at the lower bound, forward and backward, and correct.

Run ``python -m benchmarks.halo_and_conv halo_bytes``; the JSON fields are listed in README.md.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmarks._common import Goal, emit, on_ranks
from shardsci import Shard, ShardTensor, halo_exchange
from shardsci.testing import count_traffic, get_mesh

GLOBAL_SHAPE = (2, 3, 131, 64)
ITEMSIZE = torch.finfo(torch.float32).bits // 8
WIDTHS = (1, 2)
BOUNDARIES = ("periodic", "zeros")
_TORCH_PAD_MODES = {"periodic": "circular", "zeros": "constant"}


@dataclass(frozen=True)
class Decomposition:
    """Shards of ``GLOBAL_SHAPE`` over a mesh; mesh axis ``k`` shards the ``k``-th dim listed.

    Attributes
    ----------
    name : str
    sizes : dict
        Tensor dim -> shard extents along it, one per coordinate of its mesh axis.
    """

    name: str
    sizes: dict[int, tuple[int, ...]]

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(len(s) for s in self.sizes.values())

    @property
    def coordinates(self) -> list[tuple[int, ...]]:
        """Mesh coordinates in rank order (row-major)."""
        return list(itertools.product(*(range(n) for n in self.mesh_shape)))

    def own(self, coordinate: tuple[int, ...]) -> list[range]:
        """The global index range held at ``coordinate``, per tensor dim."""
        box = [range(extent) for extent in GLOBAL_SHAPE]
        for axis, (dim, sizes) in enumerate(self.sizes.items()):
            start = sum(sizes[: coordinate[axis]])
            box[dim] = range(start, start + sizes[coordinate[axis]])
        return box


SLAB = Decomposition("slab H 40/33/30/28", {2: (40, 33, 30, 28)})
BLOCK = Decomposition("2x2 block H 70/61, W 36/28", {2: (70, 61), 3: (36, 28)})


# --------------------------------------------------------------------------- lower bound
def _read(cells: range, width: int, extent: int, boundary: str) -> set[int]:
    """Global indices read by ``cells`` grown by ``width`` on each side."""
    grown = range(cells.start - width, cells.stop + width)
    if boundary == "periodic":
        return {i % extent for i in grown}
    return {i for i in grown if 0 <= i < extent}


def cells_read(decomposition: Decomposition, width: int, boundary: str) -> list[list[int]]:
    """``read[r][q]``: distinct cells of rank ``q``'s shard that rank ``r``'s halo region reads.

    The halo region is the shard grown by ``width`` along each sharded dim; cells beyond a
    ``zeros`` boundary read nothing, periodic indices wrap.
    """
    boxes = [decomposition.own(c) for c in decomposition.coordinates]
    read = []
    for box in boxes:
        grown = [
            _read(cells, width, extent, boundary) if dim in decomposition.sizes else set(cells)
            for dim, (cells, extent) in enumerate(zip(box, GLOBAL_SHAPE))
        ]
        read.append([math.prod(len(g & set(c)) for g, c in zip(grown, other)) for other in boxes])
    return read


def lower_bounds(decomposition: Decomposition, width: int, boundary: str) -> dict[str, list[int]]:
    """Least bytes each rank receives and sends: the cells it reads from others, and the
    cells others read from it (the forward pass; the backward pass swaps the two)."""
    read = cells_read(decomposition, width, boundary)
    ranks = range(len(read))
    return {
        "received": [sum(read[r][q] for q in ranks if q != r) * ITEMSIZE for r in ranks],
        "sent": [sum(read[q][r] for q in ranks if q != r) * ITEMSIZE for r in ranks],
    }


# --------------------------------------------------------------------------- rank body
def exchange_halos(decomposition: Decomposition, width: int, boundary: str) -> dict:
    """Rank body: one halo exchange, forward and backward, counted; values checked."""
    mesh = get_mesh(decomposition.mesh_shape)
    whole = torch.randn(GLOBAL_SHAPE)
    own = decomposition.own(tuple(mesh.get_coordinate()))
    local = whole[tuple(slice(r.start, r.stop) for r in own)].contiguous().requires_grad_()
    x = ShardTensor.from_local(
        local,
        mesh,
        [Shard(dim) for dim in decomposition.sizes],
        dict(enumerate(decomposition.sizes.values())),
    )
    widths = dict.fromkeys(decomposition.sizes, width)
    with count_traffic() as forward:
        extended = halo_exchange(x, widths, boundary)
    with count_traffic() as backward:
        extended.backward(torch.ones_like(extended))
    return {
        "forward": forward.as_dict(),
        "backward": backward.as_dict(),
        "correct": torch.equal(extended.detach(), _expected(whole, own, widths, boundary)),
    }


def _expected(
    whole: torch.Tensor, own: list[range], widths: dict[int, int], boundary: str
) -> torch.Tensor:
    """The extended shard cut from the whole field padded (along H and W) by ``F.pad``."""
    pad = [widths.get(dim, 0) for dim in (3, 3, 2, 2)]
    padded = F.pad(whole, pad, mode=_TORCH_PAD_MODES[boundary])
    return padded[
        tuple(slice(r.start, r.stop + 2 * widths.get(dim, 0)) for dim, r in enumerate(own))
    ]


# --------------------------------------------------------------------------- reporting
def report(decomposition: Decomposition, width: int, boundary: str) -> bool:
    """Emit one record; return whether it is correct and at the lower bound."""
    per_rank = on_ranks(
        len(decomposition.coordinates), exchange_halos, decomposition, width, boundary
    )
    received, sent, backward_received = (
        [sum(r[phase][direction].values()) for r in per_rank]
        for phase, direction in (
            ("forward", "received"),
            ("forward", "sent"),
            ("backward", "received"),
        )
    )
    bound = lower_bounds(decomposition, width, boundary)
    at_bound = received == bound["received"] and sent == bound["sent"]
    backward_at_bound = backward_received == bound["sent"]
    correct = all(r["correct"] for r in per_rank)
    emit(
        "halo",
        decomposition=decomposition.name,
        mesh=decomposition.mesh_shape,
        shape=GLOBAL_SHAPE,
        width=width,
        boundary=boundary,
        received_bytes=received,
        lower_bound_received_bytes=bound["received"],
        excess_received_bytes=[r - b for r, b in zip(received, bound["received"])],
        sent_bytes=sent,
        lower_bound_sent_bytes=bound["sent"],
        exchanges=[r["forward"]["p2p_rounds"] for r in per_rank],
        messages=[r["forward"]["calls"].get("p2p", 0) for r in per_rank],
        backward_received_bytes=backward_received,
        at_lower_bound=at_bound,
        backward_at_lower_bound=backward_at_bound,
        correct=correct,
    )
    return at_bound and backward_at_bound and correct


def run() -> tuple[dict[str, object], list[Goal]]:
    """Emit every case (on the running rank pools); return the part's summary fields and
    goals."""
    verdicts = [
        report(decomposition, width, boundary)
        for decomposition in (SLAB, BLOCK)
        for width in WIDTHS
        for boundary in BOUNDARIES
    ]
    fields = {"cases": len(verdicts), "cases_at_lower_bound": sum(verdicts)}
    goal = "every halo exchange correct and at the byte lower bound, forward and backward"
    return fields, [Goal(goal, all(verdicts))]
