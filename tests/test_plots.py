"""The rollout picture (``shardsci.training._plots``) keeps its panels apart: it is laid out by
hand, not by constrained_layout (which took 30-40 % of a plot's CPU time), so nothing else
checks that a title, a colour bar's tick labels or the curve's axis labels stay off one another
and inside the figure, for fields of any magnitude and rollouts of one to many steps."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.transforms import Bbox

from shardsci.training._plots import rollout_figure


def _rollout(steps: int, scale: float) -> tuple[torch.Tensor, torch.Tensor, dict[str, list[float]]]:
    """``(steps, 64, 64)`` predictions and truths of magnitude ``scale``, and three error
    curves spanning several decades."""
    x = torch.linspace(0, 2 * math.pi, 64, dtype=torch.float64)
    wave = torch.sin(x[:, None] + x[None, :])
    truths = torch.stack([scale * (1 + 0.1 * k) * wave for k in range(steps)])
    predictions = truths + scale * 0.03 * torch.cos(3 * x)[None, None, :]
    errors = {
        "this trajectory": [1e-4 * 3.0**k for k in range(steps)],
        "held-out mean": [2e-4 * 2.5**k for k in range(steps)],
        "persistence (held-out mean)": [0.4 + 0.01 * k for k in range(steps)],
    }
    return predictions, truths, errors


def _labelled_boxes(steps: int, scale: float) -> list[tuple[str, Bbox]]:
    """Every panel's extent with its title, tick and axis labels (an image's with its colour
    bar), and the figure title's, in display units, after the figure is drawn."""
    predictions, truths, errors = _rollout(steps, scale)
    title = (
        f"training step 600: a {steps}-step rollout of held-out trajectory 32, vorticity "
        "(relative L2 0.00443 after 1 step, 0.0188 after 10)"
    )
    figure = rollout_figure(predictions, truths, errors, title)
    renderer = FigureCanvasAgg(figure).get_renderer()
    figure.draw(renderer)
    panels = [(axis.get_title() or "curve", axis.get_tightbbox(renderer)) for axis in figure.axes]
    titles = [(text.get_text(), text.get_window_extent(renderer)) for text in figure.texts]
    return [*panels, *titles, ("figure", figure.bbox)]


@pytest.mark.parametrize(("steps", "scale"), [(1, 3e5), (2, 1e-6), (10, 0.7)])
def test_no_two_panels_of_a_rollout_picture_overlap(steps: int, scale: float) -> None:
    *panels, (_, whole) = _labelled_boxes(steps, scale)
    for name, box in panels:
        assert whole.x0 <= box.x0 and box.x1 <= whole.x1, f"{name} leaves the figure: {box}"
        assert whole.y0 <= box.y0 and box.y1 <= whole.y1, f"{name} leaves the figure: {box}"
    for (one, a), (other, b) in itertools.combinations(panels, 2):
        assert not a.overlaps(b), f"{one!r} and {other!r} overlap: {a} and {b}"
