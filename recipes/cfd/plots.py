"""Pictures for people: prediction, truth and error side by side, one PNG per evaluation."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

__all__ = ["save_comparison"]


def save_comparison(path: Path, prediction: torch.Tensor, truth: torch.Tensor, title: str) -> Path:
    """Write a three-panel PNG of one vorticity field.

    Parameters
    ----------
    path : Path
        Where to write it.
    prediction, truth : Tensor
        ``(H, W)`` fields in physical units.
    title : str
        Shown above the panels (step, relative error).
    """
    prediction, truth = prediction.detach().float().cpu(), truth.detach().float().cpu()
    error = prediction - truth
    limit = float(truth.abs().max())
    figure, axes = plt.subplots(1, 3, figsize=(12, 4), constrained_layout=True)
    panels = [
        ("prediction", prediction, "RdBu_r", -limit, limit),
        ("truth", truth, "RdBu_r", -limit, limit),
        ("error", error, "RdBu_r", -float(error.abs().max()), float(error.abs().max())),
    ]
    for axis, (name, field, cmap, low, high) in zip(axes, panels):
        image = axis.imshow(field.T, origin="lower", cmap=cmap, vmin=low, vmax=high)
        axis.set_title(name)
        axis.set_xticks([])
        axis.set_yticks([])
        figure.colorbar(image, ax=axis, shrink=0.8)
    figure.suptitle(title)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
