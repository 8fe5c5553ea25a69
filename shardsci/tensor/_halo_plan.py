"""Halo planning: which cells of a rank's extended range come from whom.

# NOTE [Halos are ranges gathered across the boundary]
Along one sharded dim each rank asks for a global index range ``[lo, hi)``: its own cells
plus halos, possibly beyond the domain (``lo < 0``, ``hi > extent``). The range is cut into
runs: cells inside the domain come from the ranks that own them (several, when shards are
narrower than the halo, empty shards included); cells outside follow the boundary:
``zeros``; ``periodic`` (index modulo the extent); ``reflect`` (mirrored about the edge cell,
as ``F.pad(mode="reflect")``); ``replicate`` (the edge cell repeated). Every rank computes
every rank's runs from the layout, so each pair of ranks exchanges at most one message per
dim, point to point, holding exactly the cells the receiver lacks: for halos no wider than the
neighbouring shards that is one message per neighbour, the face, the lower bound.
Several dims are extended one after the other (``_halo``), so edges and corners of 2-D and 3-D
block decompositions arrive with the faces of the later dims. A dim that is not sharded is a
group of one member: its runs are the boundary's (periodic wrap, reflection) taken from the
rank's own cells.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardsci.tensor._caches import cached

__all__ = ["BOUNDARIES", "HaloPlan", "Run", "domain_range", "halo_plan"]

BOUNDARIES = ("zeros", "periodic", "reflect", "replicate")


@dataclass(frozen=True)
class Run:
    """A contiguous run of the extended shard along the dim.

    Attributes
    ----------
    position, length : int
        Where the run lies in the extended shard.
    source : int or None
        Flat group index of the owner of its cells; None for zeros.
    start : int
        First global index of the owner's cells it copies (ascending).
    reversed : bool
        Placed flipped (reflect boundary).
    repeated : bool
        One cell repeated ``length`` times (replicate boundary).
    """

    position: int
    length: int
    source: int | None
    start: int
    reversed: bool = False
    repeated: bool = False

    @property
    def cells(self) -> int:
        """Cells taken from the source."""
        return 1 if self.repeated else self.length


@dataclass(frozen=True)
class HaloPlan:
    """Every member's runs along one dim: ``runs[k]`` fills member ``k``'s range.

    Attributes
    ----------
    offsets, sizes : tuple of int
        Where each member's own cells start, and how many it owns.
    ranges : tuple of (int, int)
        The global range each member wants.
    runs : tuple of tuple of Run
        ``runs[k]``: member ``k``'s range, cut into runs (NOTE above).
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]
    runs: tuple[tuple[Run, ...], ...]

    def sent(self, src: int, dst: int) -> tuple[Run, ...]:
        """The runs of ``dst`` that ``src`` provides (its message to ``dst``, in order)."""
        return self._sent[src][dst]

    def __post_init__(self) -> None:
        members = range(len(self.runs))
        sent = tuple(
            tuple(tuple(r for r in self.runs[dst] if r.source == src) for dst in members)
            for src in members
        )
        object.__setattr__(self, "_sent", sent)

    def is_direct(self, member: int, run: Run) -> bool:
        """Whether ``run`` holds ``member``'s own cells at their own place (nothing to do)."""
        return (
            run.source == member
            and not run.reversed
            and not run.repeated
            and run.start == self.ranges[member][0] + run.position
        )

    def moves_nothing(self) -> bool:
        """Whether every member wants exactly its own cells."""
        return all(
            hi - lo == size and (lo == offset or size == 0)
            for (lo, hi), offset, size in zip(self.ranges, self.offsets, self.sizes)
        )


@cached("halo plans", 4096)
def halo_plan(
    sizes: tuple[int, ...], ranges: tuple[tuple[int, int], ...], boundary: str
) -> HaloPlan:
    """Runs for every member, from the shard sizes along the dim and the wanted ranges."""
    if boundary not in BOUNDARIES:
        raise ValueError(f"unknown boundary {boundary!r}; expected one of {BOUNDARIES}")
    extent = sum(sizes)
    offsets = tuple(sum(sizes[:k]) for k in range(len(sizes)))
    runs = tuple(tuple(_runs(lo, hi, extent, offsets, sizes, boundary)) for lo, hi in ranges)
    return HaloPlan(offsets, sizes, ranges, runs)


def _runs(
    lo: int, hi: int, extent: int, offsets: tuple[int, ...], sizes: tuple[int, ...], boundary: str
) -> list[Run]:
    result: list[Run] = []
    position = 0
    for start, stop, reverse, repeat in _sources(lo, hi, extent, boundary):
        if start is None:
            result.append(Run(position, stop, None, 0))
            position += stop
            continue
        if repeat:
            owner = _owner(start, offsets, sizes)
            result.append(Run(position, stop, owner, start, repeated=True))
            position += stop
            continue
        pieces = _split_by_owner(start, stop, offsets, sizes)
        for owner, a, b in reversed(pieces) if reverse else pieces:
            result.append(Run(position, b - a, owner, a, reversed=reverse))
            position += b - a
    return result


def _sources(
    lo: int, hi: int, extent: int, boundary: str
) -> list[tuple[int | None, int, bool, bool]]:
    """``[lo, hi)`` as source runs: (start, stop, reversed, repeated); repeated runs are
    (cell, count, False, True) and zero runs (None, count, False, False)."""
    if hi <= lo:
        return []
    inside = (max(lo, 0), min(hi, extent))
    left, right = max(0, min(hi, 0) - lo), max(0, hi - max(lo, extent))
    if (left or right) and extent == 0 and boundary != "zeros":
        raise ValueError(f"cannot pad a dim of size 0 by its boundary ({boundary})")
    runs: list[tuple[int | None, int, bool, bool]] = []
    if left:
        runs += _outside(lo, min(hi, 0), extent, boundary)
    if inside[0] < inside[1]:
        runs.append((inside[0], inside[1], False, False))
    if right:
        runs += _outside(max(lo, extent), hi, extent, boundary)
    return runs


def _outside(
    a: int, b: int, extent: int, boundary: str
) -> list[tuple[int | None, int, bool, bool]]:
    """Source runs for indices ``[a, b)`` entirely below 0 or at/after ``extent``."""
    below = b <= 0
    if boundary == "zeros":
        return [(None, b - a, False, False)]
    if boundary == "replicate":
        return [(0 if below else extent - 1, b - a, False, True)]
    if boundary == "reflect":
        reach = -a if below else b - extent
        if reach > extent - 1:
            raise ValueError(
                f"reflect padding of {reach} needs a dim longer than {reach}, got {extent}"
            )
        if below:
            return [(-b + 1, -a + 1, True, False)]
        return [(2 * extent - 1 - b, 2 * extent - 1 - a, True, False)]
    runs = []
    index = a
    while index < b:
        period = index // extent
        stop = min(b, (period + 1) * extent)
        runs.append((index - period * extent, stop - period * extent, False, False))
        index = stop
    return runs


def _owner(index: int, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> int:
    return max(k for k in range(len(sizes)) if offsets[k] <= index and sizes[k])


def _split_by_owner(
    start: int, stop: int, offsets: tuple[int, ...], sizes: tuple[int, ...]
) -> list[tuple[int, int, int]]:
    pieces = []
    for k, (offset, size) in enumerate(zip(offsets, sizes)):
        a, b = max(start, offset), min(stop, offset + size)
        if a < b:
            pieces.append((k, a, b))
    return pieces


def domain_range(dim: int, lo: int, hi: int, extent: int) -> tuple[int, int, int]:
    """``(dim, start, stop)``: where the domain cells lie in a range ``[lo, hi)`` of ``dim``
    taken across a zeros boundary (NOTE [Corners beyond a zeros boundary do not travel] in
    ``_halo``)."""
    start = min(max(0, -lo), hi - lo)
    stop = max(start, hi - lo - max(0, hi - max(lo, extent)))
    return dim, start, stop
