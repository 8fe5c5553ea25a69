"""Reading one rank's nodes (or edges) of a dataset stored in the graph's original order.

A partition's nodes are scattered through a file written in the mesh's order. Sorted, they
fall into runs of consecutive rows; each run is one hyperslab read, so a rank reads its own
rows and no others (in a contiguous dataset; a chunked one is read by whole chunks).
"""

from __future__ import annotations

from collections.abc import Sequence

import h5py
import numpy as np
import torch

__all__ = ["read_rows"]


def read_rows(
    dataset: h5py.Dataset,
    rows: torch.Tensor,
    *,
    dim: int = 0,
    where: Sequence[int | slice] = (),
) -> np.ndarray:
    """``dataset[*where, rows, ...]`` with ``rows`` along ``dim``, one read per run of rows.

    Parameters
    ----------
    dataset : h5py.Dataset
        Rows along ``dim`` in the graph's original order.
    rows : Tensor
        ``(R,)`` distinct original ids (e.g. ``PartitionedGraph.local_nodes``), any order.
    dim : int
        The dataset's node (or edge) dim.
    where : sequence of int or slice
        Selection of the dims before ``dim`` (missing ones whole).

    Returns
    -------
    ndarray
        The selected dims before ``dim``, then ``R`` rows in the order of ``rows``, then the
        trailing dims whole.
    """
    if len(where) > dim:
        raise ValueError(f"where selects {len(where)} dims, but the row dim is {dim}")
    ids = rows.cpu().numpy()
    if len(ids) and (ids.min() < 0 or ids.max() >= dataset.shape[dim]):
        raise ValueError(
            f"rows must lie in [0, {dataset.shape[dim]}) for {dataset.name} of shape "
            f"{dataset.shape} (dim {dim}), got ids in [{ids.min()}, {ids.max()}]"
        )
    order = np.argsort(ids, kind="stable")
    ordered = ids[order]
    leading = tuple(where) + (slice(None),) * (dim - len(where))
    axis = _row_axis(leading, dim)
    runs = np.split(ordered, np.flatnonzero(np.diff(ordered) != 1) + 1) if len(ids) else []
    pieces = [dataset[(*leading, slice(int(run[0]), int(run[-1]) + 1))] for run in runs]
    if not pieces:
        return dataset[(*leading, slice(0, 0))]
    gathered = np.concatenate(pieces, axis=axis)
    result = np.empty_like(gathered)
    index = [slice(None)] * gathered.ndim
    index[axis] = order
    result[tuple(index)] = gathered
    return result


def _row_axis(leading: tuple, dim: int) -> int:
    """Where the row dim lands once integer selections before it have dropped their dims."""
    return dim - sum(isinstance(item, (int, np.integer)) for item in leading)
