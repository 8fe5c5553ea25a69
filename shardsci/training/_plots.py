"""Pictures for people: a held-out rollout, prediction / truth / error, and its error by step."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

__all__ = ["save_rollout"]


def save_rollout(
    path: Path,
    predictions: torch.Tensor,
    truths: torch.Tensor,
    errors: Mapping[str, Sequence[float]],
    title: str,
) -> Path:
    """Write one PNG of a rollout: prediction, truth and error at its first, middle and last
    step (one row each), and the relative L2 error at every step beside them.

    Parameters
    ----------
    path : Path
        Where to write it.
    predictions, truths : Tensor
        ``(K, H, W)`` fields in physical units at rollout steps 1..K.
    errors : mapping
        Curve label -> K relative L2 errors (step 1..K), drawn in the right-hand panel.
    title : str
        Shown above the panels.
    """
    # Imported here: matplotlib costs a second of start-up to every process that imports the
    # trainer, and only the ranks that plot need it. A Figure without pyplot draws with Agg
    # and leaves the process's backend alone.
    from matplotlib.figure import Figure

    predictions = predictions.detach().float().cpu()
    truths = truths.detach().float().cpu()
    steps = len(predictions)
    shown = sorted({1, (steps + 1) // 2, steps})
    figure = Figure(figsize=(15, 3.6 * len(shown)), constrained_layout=True)
    grid = figure.add_gridspec(len(shown), 4, width_ratios=(1, 1, 1, 1.3))
    for row, step in enumerate(shown):
        prediction, truth = predictions[step - 1], truths[step - 1]
        error = prediction - truth
        limit, error_limit = float(truth.abs().max()), float(error.abs().max())
        panels = [
            (f"prediction, step {step}", prediction, limit),
            (f"truth, step {step}", truth, limit),
            (f"error, step {step} (max {error_limit:.2g})", error, error_limit),
        ]
        for column, (name, field, high) in enumerate(panels):
            axis = figure.add_subplot(grid[row, column])
            image = axis.imshow(field.T, origin="lower", cmap="RdBu_r", vmin=-high, vmax=high)
            axis.set_title(name)
            axis.set_xticks([])
            axis.set_yticks([])
            figure.colorbar(image, ax=axis, shrink=0.8)
    curve = figure.add_subplot(grid[:, 3])
    for label, values in errors.items():
        curve.plot(range(1, len(values) + 1), values, marker="o", label=label)
    curve.set_xlabel("rollout step")
    curve.set_ylabel("relative L2 error")
    curve.set_yscale("log")
    curve.grid(True, which="both", alpha=0.3)
    curve.legend()
    figure.suptitle(title)
    figure.savefig(path, dpi=90)
    return path
