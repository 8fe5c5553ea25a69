"""Models none of us wrote, unchanged, on ShardTensors against one process (float64).

Each case is a model from a third-party package (neuraloperator, MONAI, diffusers) or built
from torch.nn's own layers (Transformer encoders, an ESPCN pixel-shuffle head), on three
layouts of its input (``1d``: 2 ranks uneven; ``empty``: 4 ranks, one shard empty; ``2x2``:
blocks uneven in opposite directions). ``check_against_reference`` compares the forward, the
input gradient, every parameter gradient, the buffers (batch-norm running statistics) and the
output's layout: the input's placements and shard sizes, or, after a pixel shuffle, the sizes
its window rule gives.

A case that fails because of a known shardsci bug is marked ``xfail(strict=True)`` and raises
``StillBroken`` only while the failure is that bug's (the same aspect, the same message): a
fix makes it pass, and strict xfail then fails until the mark is removed; a different failure
fails at once. The default run checks five cases (``DEFAULT``); ``pytest -m slow
tests/third_party`` checks every other model on every layout. ``python -m
tests.third_party.run`` prints the whole table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch

from shardsci.testing import run_on_ranks
from tests.third_party.models import CASES, LAYOUT_NAMES
from tests.third_party.run import Outcome, missing_package, outcome


class StillBroken(AssertionError):
    """A case failed exactly as its known bug makes it fail."""


@dataclass(frozen=True)
class Bug:
    """A shardsci bug some cases show.

    Attributes
    ----------
    name : str
        Short name, used in the xfail reason.
    description : str
        What goes wrong, where we think it comes from, and a reproducer.
    aspect : str
        ``"layout"`` (everything else equal) or ``"raised"`` (the same error on every rank).
    pattern : str
        A regular expression the checker's report or the error matches.
    """

    name: str
    description: str
    aspect: str
    pattern: str

    def shown_by(self, result: Outcome) -> bool:
        if self.aspect == "raised":
            return result.kind == "raised" and re.search(self.pattern, result.detail) is not None
        return (
            result.kind == "differs"
            and result.aspects == (self.aspect,)
            and re.search(self.pattern, result.detail) is not None
        )


KNOWN: dict[tuple[str, str], Bug] = {}
"""(model, layout) -> the known shardsci bug the case shows (none open)."""


#: The default run's cases: one per package and aspect (a neural operator, batch-norm
#: buffers, a diffusion UNet with attention, a Transformer layer, the pixel-shuffle head), all
#: on the 2-rank pool the suite starts anyway, so that only two processes import the packages
#: (about 12 s of CPU in all, measured in the ranks). The rest is ``slow``.
DEFAULT = {
    ("fno", "1d"),
    ("monai-unet-batchnorm", "1d"),
    ("diffusers-unet2d", "1d"),
    ("torch-encoder-layer", "1d"),
    ("espcn-pixelshuffle", "1d"),
}


def _params(slow: bool) -> list:
    """(model, layout) pairs: ``DEFAULT`` (``slow`` False) or the others; known bugs marked."""
    params = []
    for model in CASES:
        for layout in LAYOUT_NAMES:
            if ((model, layout) in DEFAULT) == slow:
                continue
            marks = [pytest.mark.slow] if slow else []
            bug = KNOWN.get((model, layout))
            if bug is not None:
                marks.append(
                    pytest.mark.xfail(strict=True, raises=StillBroken, reason=bug.description)
                )
            params.append(pytest.param(model, layout, marks=marks, id=f"{model}-{layout}"))
    return params


def _check(model: str, layout: str) -> None:
    why = missing_package(CASES[model])
    if why:
        pytest.skip(why)
    result = outcome(model, layout)
    bug = KNOWN.get((model, layout))
    if bug is not None and bug.shown_by(result):
        raise StillBroken(f"{bug.name}: {result.detail[:400]}")
    assert result.kind == "equal", f"{result.kind} {list(result.aspects)}:\n{result.detail}"


@pytest.mark.parametrize(("model", "layout"), _params(slow=False))
def test_third_party_model_equals_one_process(model: str, layout: str) -> None:
    _check(model, layout)


@pytest.mark.parametrize(("model", "layout"), _params(slow=True))
def test_third_party_model_equals_one_process_every_layout(model: str, layout: str) -> None:
    _check(model, layout)


def _unshimmed_fno_error() -> str:
    """What a float64 FNO raises on one process without the shim ("" if nothing)."""
    from neuralop.models import FNO

    torch.manual_seed(0)
    model = FNO(n_modes=(4, 4), in_channels=1, out_channels=1, hidden_channels=4).double()
    try:
        model(torch.randn(1, 1, 8, 8, dtype=torch.float64))
    except RuntimeError as exc:
        return str(exc)
    return ""


def test_the_neuraloperator_shim_is_still_needed() -> None:
    """neuraloperator's float64 FNO fails on one process without the shim (complex64 weights
    meet a complex128 spectrum); when a release fixes it, this fails: drop the shim. (Run in
    the rank pool, which imports neuraloperator anyway.)"""
    why = missing_package(CASES["fno"])
    if why:
        pytest.skip(why)
    error = run_on_ranks(2, _unshimmed_fno_error)[0]
    assert re.search(r"ComplexDouble|same dtype", error), f"no longer fails: {error!r}"
