"""Pictures for people: prediction, truth and error drawn on the triangle mesh."""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["save_mesh_comparison"]


def save_mesh_comparison(
    path: Path,
    positions: torch.Tensor,
    triangles: torch.Tensor,
    prediction: torch.Tensor,
    truth: torch.Tensor,
    title: str,
) -> Path:
    """Write a three-panel PNG of one nodal field on the mesh.

    Parameters
    ----------
    path : Path
        Where to write it.
    positions : Tensor
        ``(N, 2)`` node coordinates.
    triangles : Tensor
        ``(T, 3)`` node ids.
    prediction, truth : Tensor
        ``(N,)`` the field at the nodes, in physical units.
    title : str
        Shown above the panels.
    """
    # Imported here, as in shardsci.training._plots: only the ranks that plot pay for it.
    from matplotlib.figure import Figure
    from matplotlib.tri import Triangulation

    mesh = Triangulation(positions[:, 0].numpy(), positions[:, 1].numpy(), triangles.numpy())
    prediction, truth = prediction.detach().float().cpu(), truth.detach().float().cpu()
    error = prediction - truth
    limit, error_limit = float(truth.abs().max()), float(error.abs().max())
    figure = Figure(figsize=(15, 3.6), constrained_layout=True)
    axes = figure.subplots(1, 3)
    panels = [
        ("prediction", prediction, limit),
        ("truth", truth, limit),
        ("error", error, error_limit),
    ]
    for axis, (name, values, bound) in zip(axes, panels):
        image = axis.tripcolor(
            mesh, values.numpy(), shading="gouraud", cmap="RdBu_r", vmin=-bound, vmax=bound
        )
        axis.set_title(name)
        axis.set_aspect("equal")
        axis.set_xticks([])
        axis.set_yticks([])
        figure.colorbar(image, ax=axis, shrink=0.8)
    figure.suptitle(title)
    figure.savefig(path, dpi=90)
    return path
