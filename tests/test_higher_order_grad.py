"""Second derivatives through ShardTensors against one process (NOTE [Second derivatives
through ShardTensors] in ``shardsci/tensor/_api.py``).

For each op or model, in float64, on the same global data as a plain run, three quantities
built with ``create_graph=True`` and differentiated again:

- the gradient penalty: ``grad`` of ``|dL/dθ|²`` w.r.t. the input x and the parameters θ;
- the Hessian-vector product in x: ``grad`` of ``<dL/dx, v>`` w.r.t. x and θ (what
  ``torch.autograd.functional.hvp`` computes);
- the PINN residual: ``grad`` of ``|du/dx|²`` w.r.t. θ, ``u`` the model's output.

x is ``from_local`` of a leaf shard, so the derivatives w.r.t. x are compared as this rank's
shard of one process's; the parameters' are plain tensors, summed over the mesh; the model's
output is laid out as ``Case.layout`` says. Cases: 1 rank, 2 ranks uneven, a rank with an
empty shard, and 2x2 blocks, also with an empty block for the convolutions and for every op
whose empty shard computes nothing (pooling, interpolation, pads, unfold, products, scans,
``torch.gradient``, attention, FFTs, index reads, extrema: every rank must issue the same
collectives, NOTE [A rank with an empty shard computes nothing] in ``_ops/_common.py``), and
2x2x2 (H/W/D or three dims of a channels-last tensor), also with an empty block, for a
subset (``THREE_AXES``). The FFT cases transform split dims (the all-to-all transposes) and
truncate modes as the zoo FNO's ``SpectralConv`` does (which is also run); the index reads
(``x[idx]``, ``index_select``, ``gather``) and extrema (``amax``, ``max``/``min`` with a dim,
a full ``max``), softmax, logsumexp, variance and norms read through split dims. Where
an op cannot differentiate its backward, asking for the second derivative must raise, never
return a wrong value.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Partial, Shard
from torch.nn.attention import SDPBackend, sdpa_kernel

import shardsci
from models.fno import SpectralConv
from shardsci import ShardTensor, ShardTensorSpec
from shardsci.tensor._api import from_local_spec
from shardsci.tensor._ops import _matmul_ops
from shardsci.testing import assert_all_ranks, assert_raises_all_ranks, get_mesh, run_on_ranks

F64 = torch.float64


class _Pointwise(nn.Module):
    """``tanh(x * p)²``: pointwise ops with a parameter broadcast over the split dims."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.linspace(0.5, 1.5, channels, dtype=F64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.p).square()


class _Reduction(nn.Module):
    """A mean over the split dim 0 and a sum over dim 1, weighted."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.linspace(-1.0, 1.0, channels, dtype=F64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x * self.p).mean(dim=0) * x.square().sum(dim=0)


class _ConvNet(nn.Module):
    """A small PINN-style network: two padded 3x3 convolutions around a tanh."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Conv2d(2, 3, 3, padding=1, dtype=F64)
        self.b = nn.Conv2d(3, 1, 3, padding=1, dtype=F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class _Then(nn.Module):
    """``op(tanh(x * p))``: an op without parameters after a parameter broadcast along dim
    ``channel_dim`` (of extent ``channels``), so that every derivative depends on ``p``."""

    def __init__(
        self, op: Callable[[torch.Tensor], torch.Tensor], channels: int, ndim: int, channel_dim: int
    ) -> None:
        super().__init__()
        shape = [1] * ndim
        shape[channel_dim] = channels
        self.op = op
        self.p = nn.Parameter(torch.linspace(0.5, 1.5, channels, dtype=F64).reshape(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(torch.tanh(x * self.p))


def _math_attention(y: torch.Tensor) -> torch.Tensor:
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(y, y, y)


def _fno_modes(y: torch.Tensor) -> torch.Tensor:
    """An FNO's spectral step without weights: keep 3 x 2 modes of ``rfft2``, square them
    (a nonlinear function of the spectrum) and transform back."""
    modes = torch.fft.rfft2(y)[..., :3, :2]
    return torch.fft.irfft2(modes.square(), s=y.shape[-2:])


def _spectral_square(y: torch.Tensor, dim: tuple[int, ...]) -> torch.Tensor:
    """``ifftn(fftn(y)²)`` over ``dim``, real part: the inverse brings back y's layout (NOTE
    [Where a distributed FFT leaves the spectrum])."""
    return torch.fft.ifftn(torch.fft.fftn(y, dim=dim).square(), dim=dim).real


# Rows read along dim 0 (of 6): one twice, one never; the cells for ``gather``.
_ROWS = torch.tensor([5, 0, 3, 3, 1, 4])
_CELLS = torch.arange(6 * 5 * 4).reshape(6, 5, 4) * 7 % 6


def _then(
    op: Callable[[torch.Tensor], torch.Tensor],
    shape: tuple[int, ...],
    image: bool = True,
    layout: str = "sizes",
) -> Case:
    """A case running ``op`` after ``_Then``'s parameter, on an input of ``shape``: an image
    ``(N, C, *spatial)`` split along its last two dims, else channels last, split along the
    first two."""
    channels, channel_dim = (shape[1], 1) if image else (shape[-1], -1)
    make = functools.partial(_Then, op, channels, len(shape), channel_dim)
    n = len(shape)
    dims = ((n - 2, n - 1) + ((n - 3,) if n > 4 else ())) if image else (0, 1, 2)
    return Case(make, shape, dims, layout=layout)


def _seeded(make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return make()

    return build


@dataclass(frozen=True)
class Case:
    """A model, its input's shape and the tensor dims the mesh axes split (1-D: the first; a
    third only on a 3-axis mesh)."""

    make: Callable[[], nn.Module]
    shape: tuple[int, ...]
    dims: tuple[int, ...]
    composed: bool = False
    """Run a linear layer as its composition, not as one autograd node."""
    layout: str = "sizes"
    """The output's layout, where it has x's dims: ``"sizes"``, x's shardings; ``"dims"``,
    x's split dims and mesh axes (sizes by the op's window rule); ``"contracted"``, x's
    sharding of dim 0, a pending sum over the axes that split dim 1."""
    raises: str = ""
    """On more than one rank: the error a second derivative through it raises (its backward
    is ``first_order_only``)."""


CASES = {
    "pointwise": Case(_seeded(lambda: _Pointwise(4)), (6, 5, 4), (0, 1, 2)),
    "linear-node": Case(_seeded(lambda: nn.Linear(4, 3, dtype=F64)), (6, 5, 4), (0, 1)),
    "linear-composed": Case(
        _seeded(lambda: nn.Linear(4, 3, dtype=F64)), (6, 5, 4), (0, 1), composed=True
    ),
    "conv2d-padded": Case(
        _seeded(lambda: nn.Conv2d(2, 3, 3, padding=1, dtype=F64)), (1, 2, 6, 5), (2, 3)
    ),
    "conv-transpose2d": Case(
        _seeded(lambda: nn.ConvTranspose2d(2, 3, 3, padding=1, dtype=F64)), (1, 2, 6, 5), (2, 3)
    ),
    "groupnorm": Case(
        _seeded(lambda: nn.GroupNorm(1, 2, dtype=F64)),
        (1, 2, 6, 5),
        (2, 3),
        raises="second derivatives through a batch or group norm over split dims",
    ),
    "layernorm": Case(_seeded(lambda: nn.LayerNorm(4, dtype=F64)), (6, 5, 4), (0, 1)),
    "reduction": Case(_seeded(lambda: _Reduction(5)), (6, 5), (0, 1)),
    "convnet": Case(_ConvNet, (1, 2, 6, 5), (2, 3)),
    # Ops whose empty shard computes nothing (NOTE [A rank with an empty shard computes
    # nothing] in ``_ops/_common.py``), after a parameter.
    "maxpool2d": _then(lambda y: F.max_pool2d(y, 3, 1, 1), (1, 2, 6, 5)),
    "avgpool2d": _then(lambda y: F.avg_pool2d(y, 3, 1, 1), (1, 2, 6, 5)),
    "avgpool2d-stride2": _then(
        lambda y: F.avg_pool2d(y, 2, ceil_mode=True), (1, 2, 6, 5), layout="dims"
    ),
    "adaptive-avgpool2d": _then(
        lambda y: F.adaptive_avg_pool2d(y, (3, 5)), (1, 2, 6, 5), layout="dims"
    ),
    "adaptive-maxpool2d": _then(
        lambda y: F.adaptive_max_pool2d(y, (3, 5)), (1, 2, 6, 5), layout="dims"
    ),
    "nearest": _then(lambda y: F.interpolate(y, scale_factor=2), (1, 2, 6, 5), layout="dims"),
    "bilinear": _then(
        lambda y: F.interpolate(y, scale_factor=2, mode="bilinear"), (1, 2, 6, 5), layout="dims"
    ),
    "trilinear": _then(
        lambda y: F.interpolate(y, scale_factor=(1, 2, 2), mode="trilinear"),
        (1, 2, 2, 6, 5),
        layout="dims",
    ),
    "pad-reflect": _then(
        lambda y: F.pad(y, (1, 1, 2, 1), mode="reflect"), (1, 2, 6, 5), layout="dims"
    ),
    "pad-replicate": _then(
        lambda y: F.pad(y, (1, 1, 2, 1), mode="replicate"), (1, 2, 6, 5), layout="dims"
    ),
    "pad-circular": _then(
        lambda y: F.pad(y, (1, 1, 2, 1), mode="circular"), (1, 2, 6, 5), layout="dims"
    ),
    "unfold": _then(lambda y: y.unfold(0, 2, 1), (6, 5, 4), image=False),
    "bmm": _then(
        lambda y: torch.bmm(y.transpose(1, 2), y), (6, 5, 4), image=False, layout="contracted"
    ),
    "einsum": _then(
        lambda y: torch.einsum("bij,bik->bjk", y, y), (6, 5, 4), image=False, layout="contracted"
    ),
    "cumsum": _then(lambda y: torch.cumsum(y, 0), (6, 5, 4), image=False),
    "gradient": _then(lambda y: torch.gradient(y, dim=0)[0], (6, 5, 4), image=False),
    # (batch, heads, sequence, features), split along batch and heads: every key on each
    # rank. torch's math kernel: its fused CPU kernel has no second derivative.
    "attention": _then(_math_attention, (6, 5, 4, 3), image=False),
    # FFTs along split dims (the all-to-all transposes), with an FNO's mode truncation.
    "rfft2-modes": _then(_fno_modes, (1, 2, 6, 5), layout="dims"),
    "fftn": _then(functools.partial(_spectral_square, dim=(0, 1)), (6, 5, 4), image=False),
    "fftn-3d": _then(functools.partial(_spectral_square, dim=(2, 3, 4)), (1, 2, 4, 6, 5)),
    # Index reads through the split dim 0, with a repeated and a missing row.
    "index": _then(lambda y: y[_ROWS], (6, 5, 4), image=False),
    "index-select": _then(lambda y: y.index_select(0, _ROWS), (6, 5, 4), image=False),
    "gather": _then(lambda y: y.gather(0, _CELLS), (6, 5, 4), image=False),
    # Extrema along a split dim.
    "amax": _then(lambda y: y.amax(0), (6, 5, 4), image=False),
    "max-dim": _then(lambda y: y.max(0).values, (6, 5, 4), image=False),
    "min-dim": _then(lambda y: y.min(1).values, (6, 5, 4), image=False),
    "amax-2dims": _then(lambda y: y.amax((0, 1)), (6, 5, 4), image=False),
    "max-all": _then(lambda y: y.max() * y, (6, 5, 4), image=False),
    "softmax": _then(lambda y: torch.softmax(y, 0), (6, 5, 4), image=False),
    "logsumexp": _then(lambda y: torch.logsumexp(y, 0), (6, 5, 4), image=False),
    "var": _then(lambda y: y.var(0), (6, 5, 4), image=False),
    "norm": _then(lambda y: torch.linalg.vector_norm(y, dim=0), (6, 5, 4), image=False),
    # The zoo FNO's spectral convolution: truncated rfft/fft, complex weights, ifft/irfft.
    "spectral-conv": Case(
        _seeded(lambda: SpectralConv(2, 3, (2, 2)).double()), (1, 2, 6, 5), (2, 3)
    ),
    "spectral-conv-3d": Case(
        _seeded(lambda: SpectralConv(2, 3, (1, 2, 2)).double()), (1, 2, 4, 6, 5), (3, 4, 2)
    ),
    "conv3d-padded": Case(
        _seeded(lambda: nn.Conv3d(2, 3, 3, padding=1, dtype=F64)), (1, 2, 4, 6, 5), (3, 4, 2)
    ),
    "maxpool3d": _then(lambda y: F.max_pool3d(y, 3, 1, 1), (1, 2, 4, 6, 5)),
}

# Mesh shape and the shard sizes along the split dims (None: one rank).
LAYOUTS = {
    "1r": ((1,), None),
    "2r-uneven": ((2,), ((4, 2),)),
    "2r-empty": ((2,), ((0, 6),)),
    "2x2": ((2, 2), ((3, 3), (2, 3))),
    "2x2-empty": ((2, 2), ((0, 6), (2, 3))),
    # The third axis splits its dim as evenly as torch.chunk, or with the first shard empty.
    "2x2x2": ((2, 2, 2), ((3, 3), (2, 3), None)),
    "2x2x2-empty": ((2, 2, 2), ((4, 2), (2, 3), 0)),
}
# Layouts run for some cases only.
THREE_AXES = {
    "pointwise",
    "cumsum",
    "gradient",
    "trilinear",
    "fftn",
    "fftn-3d",
    "spectral-conv-3d",
    "index",
    "gather",
    "amax",
    "amax-2dims",
    "max-all",
    "max-dim",
    "conv3d-padded",
    "maxpool3d",
}
ONLY = {
    "2x2-empty": {"conv2d-padded", "conv-transpose2d", "convnet", "spectral-conv"}
    | {"spectral-conv-3d", "conv3d-padded"}
    | {c for c in CASES if isinstance(CASES[c].make(), _Then)},
    "2x2x2": THREE_AXES,
    "2x2x2-empty": THREE_AXES,
}


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, ShardTensor) else t


def _quantities(
    model: nn.Module, leaf: torch.Tensor, x: torch.Tensor, v: torch.Tensor
) -> list[torch.Tensor]:
    """The three second-order quantities of the module docstring, for input ``x`` (``leaf``
    itself, or a ShardTensor over the local ``leaf``) and direction ``v`` laid out as x. The
    first derivative in x, ``du``, comes first."""
    params = list(model.parameters())

    def loss() -> torch.Tensor:
        return _whole(model(x).square().sum())

    def grad(out: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(torch.autograd.grad(out, inputs, materialize_grads=True))

    first = torch.autograd.grad(loss(), params, create_graph=True, materialize_grads=True)
    found = grad(sum(g.square().sum() for g in first), [leaf, *params])

    (dx,) = torch.autograd.grad(loss(), x, create_graph=True)
    found += grad(_whole((dx * v).sum()), [leaf, *params])

    (du,) = torch.autograd.grad(_whole(model(x).sum()), x, create_graph=True)
    return [du, *found, *grad(_whole(du.square().sum()), params)]


def _layout_matches(layout: str, out: ShardTensorSpec, x: ShardTensorSpec) -> bool:
    """Whether ``out`` is laid out as ``layout`` (``Case.layout``) says for input ``x``."""
    if layout == "contracted":
        batch = [s for s in x.shardings if s.dim == 0]
        contracted = {a for s in x.shardings if s.dim == 1 for a in s.axes}
        pending = {a for a, p in enumerate(out.placements) if isinstance(p, Partial)}
        return list(out.shardings) == batch and pending == contracted

    def key(spec: ShardTensorSpec) -> list:
        return [(s.dim, s.axes, s.sizes if layout == "sizes" else None) for s in spec.shardings]

    return key(out) == key(x)


def _sizes(sizes: tuple, case: Case) -> list[tuple[int, ...]]:
    """``LAYOUTS``' shard sizes along ``case``'s split dims: a third axis's ``None`` is
    ``torch.chunk``'s halves of its dim, ``0`` an empty first shard."""
    extents = [case.shape[d] for d in case.dims]
    return [
        (e - e // 2, e // 2) if s is None else (0, e) if s == 0 else s
        for s, e in zip(sizes, extents, strict=False)
    ]


def _body(case_name: str, layout_name: str) -> None:
    case = CASES[case_name]
    mesh_shape, sizes = LAYOUTS[layout_name]
    generator = torch.Generator().manual_seed(3)
    whole = torch.randn(case.shape, dtype=F64, generator=generator)
    direction = torch.randn(case.shape, dtype=F64, generator=generator)
    leaf = whole.clone().requires_grad_()
    want = _quantities(case.make(), leaf, leaf, direction)

    mesh = get_mesh(mesh_shape)
    placements = [Shard(d) for d in case.dims[: len(mesh_shape)]]
    shapes = None if sizes is None else dict(enumerate(_sizes(sizes, case)))
    v = shardsci.distribute_tensor(direction, mesh, placements, shapes)
    leaf = v.spec.narrow(whole).clone().requires_grad_()
    x = from_local_spec(leaf, v.spec)
    raises = RAISES.get((case_name, layout_name), case.raises if mesh.size() > 1 else "")
    if raises:
        assert_raises_all_ranks(RuntimeError, raises, _quantities, case.make(), leaf, x, v)
        return
    original = _matmul_ops._one_node_plan
    if case.composed:
        _matmul_ops._one_node_plan = lambda equation, operands: None
    try:
        found = _quantities(case.make(), leaf, x, v)
    finally:
        _matmul_ops._one_node_plan = original

    out = case.make()(x)
    if out.ndim == x.ndim:
        kept = _layout_matches(case.layout, out.spec, x.spec)
        assert_all_ranks(kept, f"{case_name} {layout_name}: output {out.spec}, x {x.spec}")
    for i, (got, expected) in enumerate(zip(found, want, strict=True)):
        got = _whole(got) if i == 0 else got
        if got.shape != expected.shape:  # a derivative in x: this rank's shard
            expected = v.spec.narrow(expected)
        error = (got - expected).abs().max().item() if got.numel() else 0.0
        close = torch.allclose(got, expected, rtol=1e-10, atol=1e-10)
        assert_all_ranks(close, f"{case_name} {layout_name}: quantity {i} differs by {error:.3g}")


# Where the layout, not the case, sends a second derivative through a first_order_only
# backward: with an empty shard, a layer norm runs shardsci's norm Function.
RAISES = {("layernorm", "2r-empty"): "second derivatives through a normalisation over split dims"}


# Run by default (each under 3 s on a quiet machine); the rest are slow.
DEFAULT = {
    ("pointwise", "2r-empty"),
    ("linear-node", "2r-uneven"),
    ("linear-composed", "2x2"),
    ("conv2d-padded", "2x2"),
    ("conv2d-padded", "2r-empty"),
    ("conv2d-padded", "2x2-empty"),
    ("conv-transpose2d", "2r-empty"),
    ("groupnorm", "2r-uneven"),
    ("reduction", "2r-uneven"),
    ("convnet", "2r-uneven"),
    ("maxpool2d", "2x2-empty"),
    ("avgpool2d-stride2", "2r-uneven"),
    ("bilinear", "2r-empty"),
    ("pad-reflect", "2r-empty"),
    ("einsum", "2x2-empty"),
    ("cumsum", "2r-empty"),
    ("attention", "2r-empty"),
    ("spectral-conv", "2x2-empty"),
    ("index", "2r-empty"),
    ("gather", "2x2-empty"),
    ("max-dim", "2r-empty"),
    ("spectral-conv-3d", "2x2x2-empty"),
}


def _marks(case_name: str, layout_name: str) -> tuple[pytest.MarkDecorator, ...]:
    return () if (case_name, layout_name) in DEFAULT else (pytest.mark.slow,)


@pytest.mark.parametrize(
    ("case_name", "layout_name"),
    [
        pytest.param(c, x, id=f"{c}-{x}", marks=_marks(c, x))
        for c in CASES
        for x in LAYOUTS
        if c in ONLY.get(x, CASES)
    ],
)
def test_second_derivatives_match_one_process(case_name: str, layout_name: str) -> None:
    run_on_ranks(math.prod(LAYOUTS[layout_name][0]), _body, case_name, layout_name)
