"""Shims for bugs of third-party packages, each named, each applied to both runs of a case.

A shim changes the package, never shardsci and never the comparison: the sharded run and the
single-process reference run the same shimmed code, so a shim can hide nothing shardsci does.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType

import torch


@dataclass(frozen=True)
class Shim:
    """A named fix of a third-party bug.

    Attributes
    ----------
    name : str
        Shown in test ids and the report.
    bug : str
        What the package does wrong, with its version.
    apply : callable
        A context manager factory: the fix holds inside it (model construction and both runs).
    """

    name: str
    bug: str
    apply: Callable[[], contextlib.AbstractContextManager[None]]


class _TorchWithComplex128(ModuleType):
    """``torch`` as a module sees it, except that ``torch.cfloat`` is ``torch.cdouble``."""

    cfloat = torch.cdouble

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)


@contextlib.contextmanager
def _spectral_convolution_in_complex128() -> Iterator[None]:
    module = importlib.import_module("neuralop.layers.spectral_convolution")
    original = module.torch
    module.torch = _TorchWithComplex128("torch")
    try:
        yield
    finally:
        module.torch = original


NEURALOP_COMPLEX128 = Shim(
    "neuralop-complex128",
    "neuraloperator 2.0.0's SpectralConv hard-codes torch.cfloat (complex64) for its weights and "
    "its output spectrum, so a float64 model silently computes its spectral convolutions in "
    "single precision (|error| ~ 1e-7 on one process); the shim reads torch.cfloat as "
    "torch.cdouble inside neuralop.layers.spectral_convolution",
    _spectral_convolution_in_complex128,
)
