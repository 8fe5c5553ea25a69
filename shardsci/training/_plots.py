"""Pictures for people: a held-out rollout, prediction / truth / error, and its error by step."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["rollout_figure", "save_rollout"]

_ROW_HEIGHT = 3.6
"""Inches per shown rollout step."""

_MARGIN = 0.55
"""Inches above the panels (the title) and below them (the curve's axis label)."""

_COLOUR_BAR = (1.05, 0.1, 0.04, 0.8)
"""Where an image's colour bar goes, in the image's axes coordinates: ``(x, y, width,
height)``, constrained_layout's default placement with ``shrink=0.8``."""


def save_rollout(
    path: Path,
    predictions: torch.Tensor,
    truths: torch.Tensor,
    errors: Mapping[str, Sequence[float]],
    title: str,
) -> Path:
    """Write ``rollout_figure(...)`` to ``path`` as a PNG; return ``path``."""
    rollout_figure(predictions, truths, errors, title).savefig(path, dpi=90)
    return path


def rollout_figure(
    predictions: torch.Tensor,
    truths: torch.Tensor,
    errors: Mapping[str, Sequence[float]],
    title: str,
) -> Figure:
    """One figure of a rollout: prediction, truth and error at its first, middle and last
    step (one row each), and the relative L2 error at every step beside them.

    Parameters
    ----------
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
    height = _ROW_HEIGHT * len(shown)
    figure = Figure(figsize=(15, height))
    # A fixed layout, not constrained_layout, which took 30-40 % of a plot's CPU time: each
    # image sits at the left of its cell, its colour bar in the gap to its right, 0.8 of its
    # height; the empty fourth column keeps the curve's labels off the last colour bar.
    # tests/test_plots.py checks that no two panels' labels overlap.
    grid = figure.add_gridspec(
        len(shown),
        5,
        width_ratios=(1, 1, 1, 0.15, 1.3),
        left=0.005,
        right=0.99,
        bottom=_MARGIN / height,
        top=1 - _MARGIN / height,
        wspace=0.45,
        hspace=0.16,
    )
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
            image = axis.imshow(
                field.T.numpy(), origin="lower", cmap="RdBu_r", vmin=-high, vmax=high
            )
            axis.set_title(name)
            axis.set_xticks([])
            axis.set_yticks([])
            axis.set_anchor("W")
            figure.colorbar(image, cax=axis.inset_axes(_COLOUR_BAR))
    curve = figure.add_subplot(grid[:, 4])
    for label, values in errors.items():
        curve.plot(range(1, len(values) + 1), values, marker="o", label=label)
    curve.set_xlabel("rollout step")
    curve.set_ylabel("relative L2 error")
    curve.set_yscale("log")
    curve.grid(True, which="both", alpha=0.3)
    curve.legend()
    figure.suptitle(title)
    return figure
