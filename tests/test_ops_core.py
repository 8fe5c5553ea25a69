"""Every core op on ShardTensors against the single-process reference, forward and gradients,
float64, on even, uneven and empty shards, 1-D and 2-D meshes, and the layout of each output."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor._ops._math_ops import _NormPartial

from shardsci import gather_policy
from shardsci.handlers import from_local_spec
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    check_against_reference,
    count_traffic,
    get_mesh,
    run_on_ranks,
)
from tests.boxes import dim_shardings
from tests.expected_layouts import (
    counted,
    every_shard_even,
    on_multiples,
    over_sharded_axes,
    parse,
    reduced,
    renamed,
)
from tests.layouts import CASES, Case
from tests.stated_gathers import allowed_if


def _factors(n: int) -> tuple[int, int]:
    """(n // f, f) for the smallest factor f > 1 of n (or (n, 1) when n is prime)."""
    f = next((f for f in range(2, n) if n % f == 0), 1)
    return (n // f, f)


def _x(case: Case) -> torch.Tensor:
    return torch.randn(case.shape, dtype=torch.float64)


# Each entry: name -> (fn, makes the extra inputs and their layouts, compares gradients).
# Functions take the case so they can address the sharded dim or the last dim.
UNARY = {
    "sin_affine": lambda c: lambda x: (x * 2 + 1).sin(),
    "exp": lambda c: torch.exp,
    "relu": lambda c: torch.relu,
    "abs_pow": lambda c: lambda x: x.abs().pow(1.5),
    "clone": lambda c: torch.clone,
    "zeros_like_plus": lambda c: lambda x: torch.zeros_like(x) + x * torch.ones_like(x),
    "scalar_tensor_mul": lambda c: lambda x: x * torch.tensor(3.0, dtype=torch.float64),
    "sum_all": lambda c: torch.sum,
    "mean_all": lambda c: torch.mean,
    "var_all": lambda c: torch.var,
    "std_all": lambda c: torch.std,
    "norm_all": lambda c: torch.linalg.vector_norm,
    "norm_inf": lambda c: lambda x: torch.linalg.vector_norm(x, float("inf")),
    "amax_all": lambda c: torch.amax,
    "amin_all": lambda c: torch.amin,
    "max_all": lambda c: torch.max,
    "transpose": lambda c: lambda x: x.transpose(0, 2) * 2,
    "permute": lambda c: lambda x: x.permute(2, 0, 1).sin(),
    "unsqueeze_squeeze": lambda c: lambda x: x.unsqueeze(1).sin().squeeze(1),
    "flatten_trailing": lambda c: lambda x: x.flatten(c.sharded_dim).sin(),
    "reshape_trailing": lambda c: lambda x: x.reshape(*x.shape[: c.sharded_dim], -1).cos(),
    "unflatten_last": lambda c: lambda x: x.unflatten(-1, _factors(x.shape[-1])).sin(),
    "unflatten_sharded": lambda c: (
        lambda x: x.unflatten(c.sharded_dim, _factors(x.shape[c.sharded_dim])).sin()
    ),
    "slice_sharded": lambda c: lambda x: x.narrow(c.sharded_dim, 1, x.shape[c.sharded_dim] - 2),
    "step_slice_sharded": lambda c: (
        lambda x: x[(slice(None),) * c.sharded_dim + (slice(1, None, 2),)]
    ),
    "select_sharded": lambda c: lambda x: x.select(c.sharded_dim, x.shape[c.sharded_dim] - 2),
    "select_other": lambda c: lambda x: x[:, 1] if c.sharded_dim != 1 else x[..., 1],
    "index_sharded": lambda c: (
        lambda x: x.index_select(c.sharded_dim, torch.tensor([0, x.shape[c.sharded_dim] - 1, 1]))
    ),
    "roll_sharded": lambda c: lambda x: x.roll(3, c.sharded_dim),
    "roll_negative": lambda c: lambda x: x.roll(-2, c.sharded_dim),
    "flip_sharded": lambda c: lambda x: x.flip(c.sharded_dim),
    "flip_two": lambda c: lambda x: x.flip(0, 1),
    "cat_self_sharded": lambda c: lambda x: torch.cat([x, x * 2], dim=c.sharded_dim),
    "cat_last": lambda c: lambda x: torch.cat([x, x.sin()], dim=-1),
    "stack": lambda c: lambda x: torch.stack([x, x.cos()], dim=0),
    "layer_norm": lambda c: lambda x: F.layer_norm(x, x.shape[-1:]),
    "mse_to_sin": lambda c: lambda x: F.mse_loss(x, x.detach().sin()),
    "l1_to_sin": lambda c: lambda x: F.l1_loss(x, x.detach().sin()),
    "mse_sum": lambda c: lambda x: F.mse_loss(x, torch.zeros_like(x), reduction="sum"),
    "copy_into": lambda c: lambda x: torch.zeros_like(x).copy_(x.sin()),
}
PER_DIM = {
    "sum_dim": lambda d: lambda x: x.sum(d),
    "mean_dim": lambda d: lambda x: x.mean(d, keepdim=True),
    "var_dim": lambda d: lambda x: x.var(d),
    "std_dim": lambda d: lambda x: x.std(d, correction=0),
    "norm_dim": lambda d: lambda x: x.norm(dim=d),
    "amax_dim": lambda d: lambda x: x.amax(d),
    "amin_dim": lambda d: lambda x: x.amin(d, keepdim=True),
    "softmax": lambda d: lambda x: torch.softmax(x, d),
    "log_softmax": lambda d: lambda x: F.log_softmax(x, dim=d),
    "cumsum": lambda d: lambda x: x.cumsum(d),
}
NO_GRAD_PER_DIM = {
    "argmax_dim": lambda d: lambda x: x.argmax(d),
    "argmin_dim": lambda d: lambda x: x.argmin(d, keepdim=True),
}
NO_GRAD = {
    "argmax_all": lambda c: torch.argmax,
    "argmin_all": lambda c: torch.argmin,
}


# ---------------------------------------------------------------------------- expected layouts
# Name -> the layout of its output, from the case; absent: the input's layout. A full
# reduction is Partial where each shard's own result combines into the answer, Replicate where
# it was computed with communication.
def _mean_partial(c: Case) -> Partial:
    """A mean of unequal shards is rescaled into a Partial sum; of equal ones an average."""
    return Partial("avg") if every_shard_even(c.layout, c.shape, c.mesh) else Partial("sum")


def _dim_sizes(c: Case, dim: int) -> tuple[int, ...]:
    return dim_shardings(c.layout, c.shape, c.mesh)[dim][1]


def _with_sizes(c: Case, dim: int, sizes: tuple[int, ...]) -> Layout:
    return Layout(c.layout.placements, {**dict(c.layout.sizes), dim: sizes})


def _flattened(c: Case) -> Layout:
    """``flatten(d)``: dim ``d`` absorbs the trailing dims; a block's inner sharded dim is
    first nested onto it (each piece chunked)."""
    d = c.sharded_dim
    return {
        "2x2-block": parse("S0,S0; 0=24/12/12/12"),
        "2x2-nested": parse("S0,S0; 0=24/12/0/36"),
    }.get(c.name) or renamed(c.layout, c.shape, c.mesh, {}, {d: math.prod(c.shape[d + 1 :])})


def _unflattened(c: Case) -> Layout:
    """``unflatten(d, (n / f, f))``: boundaries move to the nearest multiples of ``f``."""
    d = c.sharded_dim
    resized = _with_sizes(c, d, on_multiples(_dim_sizes(c, d), _factors(c.shape[d])[1]))
    return renamed(resized, c.shape, c.mesh, {e: e + 1 for e in range(d + 1, len(c.shape))})


def _kept(c: Case, indices: range) -> Layout:
    d = c.sharded_dim
    return _with_sizes(c, d, counted(_dim_sizes(c, d), indices))


def _full(placement: Placement) -> Callable[[Case], Layout]:
    return lambda c: over_sharded_axes(c.layout, placement)


def _moved(dims: dict[int, int]) -> Callable[[Case], Layout]:
    return lambda c: renamed(c.layout, c.shape, c.mesh, dims)


UNARY_LAYOUTS: dict[str, Callable[[Case], Layout]] = {
    "sum_all": _full(Partial("sum")),
    "mse_sum": _full(Partial("sum")),
    "mse_to_sin": _full(Partial("sum")),
    "var_all": _full(Partial("sum")),
    "mean_all": lambda c: over_sharded_axes(c.layout, _mean_partial(c)),
    "l1_to_sin": lambda c: over_sharded_axes(c.layout, _mean_partial(c)),
    "std_all": _full(Replicate()),
    "norm_all": _full(_NormPartial(2)),
    "norm_inf": _full(Partial("max")),
    "amax_all": _full(Partial("max")),
    "max_all": _full(Partial("max")),
    "amin_all": _full(Partial("min")),
    "argmax_all": _full(Replicate()),
    "argmin_all": _full(Replicate()),
    "transpose": _moved({0: 2, 2: 0}),
    "permute": _moved({2: 0, 0: 1, 1: 2}),
    "stack": _moved({0: 1, 1: 2, 2: 3}),
    "flatten_trailing": _flattened,
    "reshape_trailing": _flattened,
    "unflatten_last": lambda c: c.layout,
    "unflatten_sharded": _unflattened,
    "slice_sharded": lambda c: _kept(c, range(1, c.shape[c.sharded_dim] - 1)),
    "step_slice_sharded": lambda c: _kept(c, range(1, c.shape[c.sharded_dim], 2)),
    "select_sharded": lambda c: reduced(c.layout, c.shape, c.mesh, [c.sharded_dim], Replicate()),
    "select_other": lambda c: reduced(
        c.layout, c.shape, c.mesh, [1 if c.sharded_dim != 1 else 2], Replicate()
    ),
    "index_sharded": lambda c: _split_by_owners(c, [0, c.shape[c.sharded_dim] - 1, 1]),
    "cat_self_sharded": lambda c: renamed(c.layout, c.shape, c.mesh, {}, {c.sharded_dim: 2}),
    "cat_last": lambda c: c.layout,
}


def _reduction(placement: Placement | Callable[[Case, int], Placement], keepdim: bool = False):
    def layout(c: Case, dim: int) -> Layout:
        chosen = placement(c, dim) if callable(placement) else placement
        return reduced(c.layout, c.shape, c.mesh, [dim], chosen, keepdim)

    return layout


def _mean_dim_partial(c: Case, dim: int) -> Partial:
    sizes = dim_shardings(c.layout, c.shape, c.mesh).get(dim, ((), (1,)))[1]
    return Partial("avg") if sizes[0] > 0 and len(set(sizes)) == 1 else Partial("sum")


PER_DIM_LAYOUTS: dict[str, Callable[[Case, int], Layout]] = {
    "sum_dim": _reduction(Partial("sum")),
    "mean_dim": _reduction(_mean_dim_partial, keepdim=True),
    "var_dim": _reduction(Partial("sum")),
    "std_dim": _reduction(Replicate()),
    "norm_dim": _reduction(_NormPartial(2)),
    "amax_dim": _reduction(Partial("max")),
    "amin_dim": _reduction(Partial("min"), keepdim=True),
    "argmax_dim": _reduction(Replicate()),
    "argmin_dim": _reduction(Replicate(), keepdim=True),
}
# Candidates (value, index) of a (3, 4) result from four ranks outweigh a 6-row input.
_HEAVY_CANDIDATES = {("argmax_dim", "2x2-nested", 0), ("argmin_dim", "2x2-nested", 0)}


# Reads through a plain index into the sharded dim that the guard counts as gathers (NOTE
# [Gathers an op was not asked to make]): none; ``index_sharded``'s rows are split by owners.
REPLICATED_READS: set[str] = set()


def _split_by_owners(c: Case, rows: list[int]) -> Layout:
    """``x.index_select(d, rows)`` along the sharded dim ``d``: split over its axes, each rank
    holding as many entries as name its rows (NOTE [A selection through a replicated index is
    split by its entries' owners] in ``_gather_scatter_ops``)."""
    kept = renamed(c.layout, c.shape, c.mesh, {})
    d = c.sharded_dim
    return Layout(kept.placements, {**kept.sizes, d: counted(kept.sizes[d], rows)})


def _unary_body(case: Case, name: str) -> None:
    mesh = get_mesh(case.mesh)
    table = UNARY if name in UNARY else NO_GRAD
    expected = UNARY_LAYOUTS.get(name, lambda c: c.layout)(case)
    with allowed_if(name in REPLICATED_READS):
        check_against_reference(
            table[name](case),
            [_x(case)],
            [case.layout],
            mesh,
            out_layouts=[expected],
            grad=name in UNARY,
            what=name,
        )


def _per_dim_body(case: Case, name: str, dim: int) -> None:
    mesh = get_mesh(case.mesh)
    table = PER_DIM if name in PER_DIM else NO_GRAD_PER_DIM
    expected = PER_DIM_LAYOUTS.get(name, lambda c, d: c.layout)(case, dim)
    check_against_reference(
        table[name](dim),
        [_x(case)],
        [case.layout],
        mesh,
        out_layouts=[expected],
        grad=name in PER_DIM,
        not_a_gather="argmax candidates" if (name, case.name, dim) in _HEAVY_CANDIDATES else "",
        what=name,
    )


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("name", [*UNARY, *NO_GRAD])
def test_unary(case: Case, name: str) -> None:
    run_on_ranks(case.world, _unary_body, case, name)


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("name", [*PER_DIM, *NO_GRAD_PER_DIM])
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_per_dim(case: Case, name: str, dim: int) -> None:
    run_on_ranks(case.world, _per_dim_body, case, name, dim)


# ---------------------------------------------------------------------------- two operands
def _binary_body(case: Case, name: str) -> None:
    mesh = get_mesh(case.mesh)
    x, y = _x(case), _x(case)
    if name == "same_layout":
        check_against_reference(torch.mul, [x, y], [case.layout, case.layout], mesh, what=name)
    elif name == "different_boundaries":
        fn = lambda a, b: a * b + a  # noqa: E731
        check_against_reference(fn, [x, y], [case.layout, case.alternate], mesh, what=name)
    elif name == "plain_broadcast":
        bias = torch.randn(case.shape[-1], dtype=torch.float64)
        check_against_reference(torch.add, [x, bias], [case.layout, None], mesh, what=name)
    elif name == "plain_full":
        check_against_reference(torch.sub, [x, y], [case.layout, None], mesh, what=name)
    elif name == "replicated_operand":
        replicated = type(case.layout)(tuple(_replicate(case)))
        check_against_reference(torch.mul, [x, y], [case.layout, replicated], mesh, what=name)
    elif name == "where":
        fn = lambda a, b: torch.where(a > 0, a, b)  # noqa: E731
        check_against_reference(fn, [x, y], [case.layout, case.alternate], mesh, what=name)


def _replicate(case: Case):
    from torch.distributed.tensor import Replicate

    return [Replicate()] * len(case.mesh)


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize(
    "name",
    [
        "same_layout",
        "different_boundaries",
        "plain_broadcast",
        "plain_full",
        "replicated_operand",
        "where",
    ],
)
def test_binary(case: Case, name: str) -> None:
    run_on_ranks(case.world, _binary_body, case, name)


# ---------------------------------------------------------------------------- modules and matmuls
def _matmul_body(case: Case, name: str) -> None:
    mesh = get_mesh(case.mesh)
    x = _x(case)
    width = case.shape[-1]
    # The last dim is never sharded here: every output keeps the input's sharded dims.
    kept = [case.layout]
    if name == "linear":
        module = nn.Linear(width, 5, dtype=torch.float64)
        check_against_reference(
            lambda m, a: m(a), [x], [case.layout], mesh, module=module, out_layouts=kept, what=name
        )
    elif name == "layer_norm_module":
        module = nn.LayerNorm(width, dtype=torch.float64)
        with torch.no_grad():
            module.weight.normal_()
            module.bias.normal_()
        check_against_reference(
            lambda m, a: m(a), [x], [case.layout], mesh, module=module, what=name
        )
    elif name == "matmul_plain":
        w = torch.randn(width, 6, dtype=torch.float64)
        check_against_reference(
            torch.matmul, [x, w], [case.layout, None], mesh, out_layouts=kept, what=name
        )
    elif name == "einsum":
        w = torch.randn(width, 2, dtype=torch.float64)
        fn = lambda a, b: torch.einsum("ijk,kl->ijl", a, b)  # noqa: E731
        check_against_reference(fn, [x, w], [case.layout, None], mesh, out_layouts=kept, what=name)
    elif name == "bmm":
        w = torch.randn(case.shape[0], width, 3, dtype=torch.float64)
        check_against_reference(
            torch.bmm, [x, w], [case.layout, None], mesh, out_layouts=kept, what=name
        )


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("name", ["linear", "layer_norm_module", "matmul_plain", "einsum", "bmm"])
def test_matmul_and_modules(case: Case, name: str) -> None:
    run_on_ranks(case.world, _matmul_body, case, name)


# ---------------------------------------------------------------------------- strides
def _clone_strides_body() -> None:
    from torch.distributed.tensor import Shard

    from shardsci.tensor._api import from_local_spec

    mesh = get_mesh((2,))
    x = torch.randn(4, 3, 2, dtype=torch.float64)
    spec = Layout((Shard(1),), {1: (1, 2)}).spec(mesh, x)
    sharded = from_local_spec(spec.narrow(x).clone(), spec).transpose(0, 1)
    for memory_format in (torch.contiguous_format, torch.preserve_format):
        expected = x.transpose(0, 1).clone(memory_format=memory_format).stride()
        got = sharded.clone(memory_format=memory_format).stride()
        if got != expected:
            raise AssertionError(f"clone({memory_format}) has strides {got}, torch {expected}")


def test_clone_to_a_memory_format_has_its_strides() -> None:
    """A contiguous clone of a transposed ShardTensor is contiguous (a later ``view`` of it,
    as in multi-head attention, relies on that)."""
    run_on_ranks(2, _clone_strides_body)


# ---------------------------------------------------------------------------- shard-size hints
def _newest_hint_body() -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    from shardsci.tensor._propagation import _remembered
    from shardsci.tensor._spec import DimSharding, ShardTensorSpec

    older, newer = DimSharding(0, (0,), (1, 5)), DimSharding(1, (0,), (4, 2))
    spec = ShardTensorSpec.build(
        get_mesh((2,)), [Replicate()], (6, 6), torch.float64, hints=(older, newer)
    )
    return _remembered([spec], (0,), 6)


def test_propagation_takes_the_newest_hint() -> None:
    """NOTE [Shard-size hints]: every reader prefers the newest hint of an axes and extent."""
    assert run_on_ranks(2, _newest_hint_body) == [((0,), (4, 2))] * 2  # (nesting, sizes)


# ---------------------------------------------------------------------------- views of empty tensors
def _empty_views_body(mesh_shape: tuple[int, ...]) -> None:
    mesh = get_mesh(mesh_shape)
    if len(mesh_shape) == 1:
        x = torch.zeros(4, 0, dtype=torch.float64)
        sharded = Layout((Shard(0),), {0: (1, 3)})
        cases = [  # (view, the output's layout)
            (lambda t: t.unflatten(1, (2, 0, 0, 0)), sharded),
            (lambda t: t.reshape(2, 2, 0), None),  # dim 0 is split: no group keeps it
            (lambda t: t.reshape(0, 4), Layout((Replicate(),))),
        ]
        # A dim of no cells padded with a constant (the padding of the sharded dim goes to the
        # edge ranks).
        y = torch.randn(0, 3, 3, dtype=torch.float64)
        check_against_reference(
            lambda t: F.pad(t, (1, 1, 1, 1, 1, 1), value=1.0),
            [y], [Layout((Shard(1),), {1: (1, 2)})], mesh,
            out_layouts=[Layout((Shard(1),), {1: (2, 3)})], what="pad",
        )  # fmt: skip
    else:
        x = torch.zeros(4, 6, 0, dtype=torch.float64)
        sharded = Layout((Shard(0), Shard(1)), {0: (3, 1), 1: (2, 4)})
        cases = [
            (lambda t: t.unflatten(2, (3, 0)), sharded),
            (lambda t: t.reshape(4, 0, 6), Layout((Shard(0), Replicate()), {0: (3, 1)})),
        ]
    for fn, out in cases:
        out_layouts = [out if out is not None else Layout((Replicate(),))]
        check_against_reference(fn, [x], [sharded], mesh, out_layouts=out_layouts)


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_views_of_empty_tensors_end(mesh_shape: tuple[int, ...]) -> None:
    """NOTE [Views of empty tensors]: torch's view rule never returns on ``(4, 0) -> (4, 2, 0,
    0, 0)`` (``unflatten`` of an empty dim); the op-database sweep hung there. And a dim of no
    cells can be padded with a constant (it raised "cannot pad a dim of size 0")."""
    run_on_ranks(math.prod(mesh_shape), _empty_views_body, mesh_shape, timeout_s=60)


def _expand_a_sharded_unit_dim_body() -> None:
    mesh = get_mesh((4,))
    x = torch.randn(1, 3, dtype=torch.float64)
    one_owner = Layout((Shard(0),), {0: (0, 1, 0, 0)})
    # The owner expands its row, the others their empty shard: the expansion stays with the
    # owner (NOTE [A dim one rank holds is whole on that rank]).
    for name, fn, out in [
        ("expand", lambda t: t.expand(2, 5, 3), Layout((Shard(1),), {1: (0, 5, 0, 0)})),
        (
            "broadcast_to",
            lambda t: torch.broadcast_to(t, (5, 3)),
            Layout((Shard(0),), {0: (0, 5, 0, 0)}),
        ),
        ("kept", lambda t: t.expand(1, 3) * 2, one_owner),
    ]:
        check_against_reference(
            fn, [x], [one_owner], mesh, out_layouts=[out], what=name,
            not_a_gather="every rank's expansion is made of the owner's one row",
        )  # fmt: skip


def test_expanding_a_sharded_dim_of_extent_one() -> None:
    """The one rank holding the element expands it and keeps the result (DTensor's rule raised a
    KeyError; then the owner broadcast it)."""
    run_on_ranks(4, _expand_a_sharded_unit_dim_body)


def _prelu_body(mesh_shape: tuple[int, ...]) -> None:
    mesh = get_mesh(mesh_shape)
    x = torch.randn(4, 5, 6, dtype=torch.float64)
    if len(mesh_shape) == 1:  # channels over 4 ranks, one of them empty; then the last dim
        layouts = [Layout((Shard(1),), {1: (0, 3, 1, 1)}), Layout((Shard(2),), {2: (3, 0, 2, 1)})]
    else:  # channels and the last dim over a 2x2 mesh
        layouts = [Layout((Shard(1), Shard(2)), {1: (2, 3), 2: (5, 1)})]
    for layout in layouts:
        for channels in (5, 1):
            module = nn.PReLU(channels, dtype=torch.float64)
            with torch.no_grad():
                module.weight.uniform_(-1, 1)
            check_against_reference(
                lambda m, t: m(t), [x], [layout], mesh, module=module, what=f"{channels}"
            )


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_prelu_weight_gradient_with_sharded_channels(mesh_shape: tuple[int, ...]) -> None:
    """Each weight's gradient sums over the cells it scales: with channels sharded, each rank
    holds its channels' sums (the kernel's gradient could not be summed to the weight's shape
    on a rank holding some channels)."""
    run_on_ranks(math.prod(mesh_shape), _prelu_body, mesh_shape)


def _broadcast_matmul_body() -> None:
    a = torch.randn(5, 10, dtype=torch.float64)
    b = torch.randn(5, 10, 5, dtype=torch.float64)
    with gather_policy("allow"):  # the pending sum held whole that the case states
        check_against_reference(
            torch.matmul, [a, b], [Layout((Shard(1),), {1: (0, 4, 3, 3)}), None], get_mesh((4,)),
            out_layouts=[Layout((Partial(),))],  # each rank's partial sum over its part of k
        )  # fmt: skip


def test_a_matrix_times_a_batch_contracting_the_sharded_dim() -> None:
    """Its backward views a replicated gradient that each rank holds in a layout the view
    cannot take (the shard is then copied, as for sharded views); it raised."""
    run_on_ranks(4, _broadcast_matmul_body)


def _all_over_dims_body(mesh_shape: tuple[int, ...]) -> None:
    mesh = get_mesh(mesh_shape)
    x = torch.randn(3, 5, dtype=torch.float64).sign().clamp(min=0)
    x[1] = 1  # a row where every element holds
    if len(mesh_shape) == 1:
        layout, rows = (
            Layout((Shard(0),), {0: (0, 1, 2, 0)}),
            Layout((Shard(0),), {0: (0, 1, 2, 0)}),
        )
    else:
        layout = Layout((Shard(0), Shard(1)), {0: (1, 2), 1: (4, 1)})
        rows = Layout((Shard(0), Replicate()), {0: (1, 2)})
    whole = Layout((Replicate(),) * len(mesh_shape))
    for dims, keepdim, out in [((0, 1), False, whole), ((0, -1), True, whole), ((1,), False, rows)]:
        check_against_reference(
            lambda t, d=dims, k=keepdim: torch.all(t > 0, dim=d, keepdim=k), [x], [layout], mesh,
            out_layouts=[out], grad=False, what=f"dims {dims} keepdim {keepdim}",
        )  # fmt: skip


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_all_over_several_dims(mesh_shape: tuple[int, ...]) -> None:
    """``torch.all(x, dim=(...))`` had no rule (DTensor has one for ``any`` only)."""
    run_on_ranks(math.prod(mesh_shape), _all_over_dims_body, mesh_shape)


def _native_group_norm_body(mesh_shape: tuple[int, ...]) -> None:
    # (N, C, *spatial), groups, input layout, layout of the mean and rstd (N, G). Channel
    # shards move to group boundaries (rounded to the nearer one); the statistics are sharded
    # like the groups and replicated over the axes that shard spatial dims, except along axes
    # where one rank holds the reduced dims whole: there they stay with it.
    whole = Layout((Replicate(),) * len(mesh_shape))
    if len(mesh_shape) == 1:
        cases = [
            # one group: one rank's, and its statistics stay with it (NOTE [A sum over a dim
            # one rank holds stays with that rank])
            ((1, 2), 1, Layout((Shard(1),), {1: (1, 1)}), Layout((Shard(0),), {0: (0, 1)})),
            ((2, 4, 3), 1, Layout((Shard(1),), {1: (1, 3)}), Layout((Shard(0),), {0: (0, 2)})),
            ((2, 4, 3), 2, Layout((Shard(1),), {1: (1, 3)}), Layout((Shard(1),), {1: (0, 2)})),
            ((2, 6, 4), 3, Layout((Shard(1),), {1: (4, 2)}), Layout((Shard(1),), {1: (2, 1)})),
            ((2, 4, 7), 2, Layout((Shard(2),), {2: (6, 1)}), whole),
            ((3, 4, 5, 2), 2, Layout((Shard(0),), {0: (0, 3)}), Layout((Shard(0),), {0: (0, 3)})),
        ]
    else:
        cases = [
            # W held by one rank of axis 1: the statistics stay with it along that axis
            ((2, 4, 5, 3), 2, Layout((Shard(2), Shard(3)), {2: (1, 4), 3: (3, 0)}),
             Layout((Replicate(), Shard(0)), {0: (2, 0)})),
            ((2, 6, 5), 3, Layout((Shard(1), Shard(2)), {1: (4, 2), 2: (2, 3)}),
             Layout((Shard(1), Replicate()), {1: (2, 1)})),
        ]  # fmt: skip
    for shape, groups, layout, statistics in cases:
        n, c, hw = shape[0], shape[1], math.prod(shape[2:])
        check_against_reference(
            lambda t, w, b, a=(n, c, hw, groups): torch.native_group_norm(t, w, b, *a, 1e-5),
            [torch.randn(shape, dtype=torch.float64), torch.randn(c, dtype=torch.float64),
             torch.randn(c, dtype=torch.float64)], [layout, None, None],
            get_mesh(mesh_shape), out_layouts=[None, statistics, statistics],
            what=f"{shape} in {groups} groups, {layout}",
        )  # fmt: skip


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_native_group_norm(mesh_shape: tuple[int, ...]) -> None:
    """Gradients through all three outputs (normalised input, mean, rstd) and the weight and
    bias match one process; the output keeps the input's layout (sharded channels, spatial
    dims, batch), the statistics are sharded like the groups: the channels were gathered and
    the outputs replicated, and a sharded spatial dim was replicated by DTensor's rule."""
    run_on_ranks(math.prod(mesh_shape), _native_group_norm_body, mesh_shape)


def _norms_without_identity_body() -> None:
    x = torch.randn(3, 4, dtype=torch.float64)
    layout = Layout((Shard(0),), {0: (0, 1, 2, 0)})
    pending = {float("inf"): Partial("max"), -float("inf"): Partial("min")}
    for order in (-2.1, -1, float("inf"), -float("inf")):
        whole = Layout((pending.get(order, _NormPartial(order)),))
        for dim, out in [(None, whole), (1, layout), (0, whole)]:
            check_against_reference(
                lambda t, o=order, d=dim: torch.linalg.vector_norm(t, o, dim=d),
                [x], [layout], get_mesh((4,)), out_layouts=[out], what=f"ord {order} dim {dim}",
            )  # fmt: skip


def test_norms_without_an_identity_on_empty_shards() -> None:
    """Negative and infinite orders: torch refuses them on an empty tensor, so a rank holding
    no rows contributes the value that adds nothing (it raised)."""
    run_on_ranks(4, _norms_without_identity_body)


# ---------------------------------------------------------------------------- pending operands
# A norm over a sharded dim is pending (Partial) over the axes that sharded it. A pointwise op
# that must reduce it reduces it to the layout its output takes: replicated over those axes,
# the other shards kept (NOTE [A pending sum is reduced rather than an operand gathered]).
# DTensor's cheaper choice reduce-scattered it onto the batch dim, and ``F.normalize`` on 2-D
# blocks returned its output split along the batch. (B, C, H, W), H sharded, W too on 2-D.
PENDING_SHAPE = (2, 3, 6, 5)
PENDING_LAYOUTS = {
    "2r-uneven": ((2,), Layout((Shard(2),), {2: (5, 1)})),
    "4r-empty": ((4,), Layout((Shard(2),), {2: (2, 0, 3, 1)})),
    "2x2-blocks": ((2, 2), Layout((Shard(2), Shard(3)), {2: (1, 5), 3: (5, 0)})),
    "2x2x2-nested": (
        (2, 2, 2),
        Layout((Shard(2), Shard(3), Shard(2)), {2: (2, 0, 3, 1), 3: (2, 3)}, {2: (0, 2), 3: (1,)}),
    ),
}


def _without_dim(layout: Layout, dim: int) -> Layout:
    """``layout`` with ``dim`` no longer sharded: its axes replicated, the other shards kept."""
    return Layout(
        tuple(Replicate() if p == Shard(dim) else p for p in layout.placements),
        {d: s for d, s in layout.sizes.items() if d != dim},
        {d: a for d, a in layout.order.items() if d != dim},
    )


def _pending_operand_body(name: str) -> None:
    mesh_shape, layout = PENDING_LAYOUTS[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    x = torch.randn(PENDING_SHAPE, dtype=torch.float64)
    floor = torch.rand(2, 3, 1, 5, dtype=torch.float64) * 4
    row = _without_dim(layout, 2)
    cases = {  # name: (fn, inputs, their layouts, output layout: None is the input's)
        "normalize p=2 over H": (lambda t: F.normalize(t, dim=2), [x], [layout], None),
        "normalize p=1 over H": (lambda t: F.normalize(t, p=1.0, dim=2), [x], [layout], None),
        "normalize over C": (lambda t: F.normalize(t, dim=1), [x], [layout], None),
        "clamp_min of a norm": (
            lambda t: t.norm(dim=2, keepdim=True).clamp_min(1e-3), [x], [layout], row,
        ),
        "maximum of a norm and a plain tensor": (
            lambda t, f: torch.maximum(t.norm(p=1, dim=2, keepdim=True), f),
            [x, floor], [layout, None], row,
        ),
    }  # fmt: skip
    for what, (fn, inputs, layouts, out) in cases.items():
        check_against_reference(fn, inputs, layouts, mesh, out_layouts=[out], what=what)


@pytest.mark.parametrize("name", list(PENDING_LAYOUTS))
def test_a_pointwise_op_reduces_a_pending_operand_to_its_output_layout(name: str) -> None:
    """Values, gradients and the output's placements and shard sizes against one process."""
    run_on_ranks(math.prod(PENDING_LAYOUTS[name][0]), _pending_operand_body, name)


# ---------------------------------------------------------------------------- row-sharded products
# NOTE [A row-sharded product keeps its rows]: ``aten.mm``/``aten.addmm`` (reached below the
# function handlers, as inside ``F.multi_head_attention_forward``) of rows sharded over any
# mesh axes, in any nesting, times a replicated matrix: no bytes move and the output keeps the
# rows' placements, order and sizes. (12, 5) rows times (5, 3); the weight's gradient
# transposes the rows, keeping their order (tests/test_nested_order.py).
ROW_LAYOUTS = {
    "2r-uneven": ((2,), Layout((Shard(0),), {0: (7, 5)})),
    "4r-empty": ((4,), Layout((Shard(0),), {0: (5, 0, 4, 3)})),
    "2x2-nested": ((2, 2), Layout((Shard(0), Shard(0)), {0: (3, 2, 0, 7)})),
    "2x2-nested-inner-first": (
        (2, 2),
        Layout((Shard(0), Shard(0)), {0: (4, 1, 2, 5)}, {0: (1, 0)}),
    ),
    "2x2x2-nested": ((2, 2, 2), Layout((Shard(0),) * 3, {0: (2, 0, 3, 1, 1, 2, 0, 3)})),
}


def _row_sharded_products_body(name: str) -> None:
    mesh_shape, layout = ROW_LAYOUTS[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    x = torch.randn(12, 5, dtype=torch.float64)
    w = torch.randn(5, 3, dtype=torch.float64)
    bias = torch.randn(3, dtype=torch.float64)
    aten = torch.ops.aten
    cases = {  # name: (fn, inputs)
        "mm": (lambda t, m: aten.mm.default(t, m), [x, w]),
        "addmm": (lambda t, m, b: aten.addmm.default(b, t, m, beta=0.5, alpha=2.0), [x, w, bias]),
        "addmm, a row bias": (lambda t, m, b: aten.addmm.default(b[None], t, m), [x, w, bias]),
    }
    for what, (fn, inputs) in cases.items():
        layouts = [layout] + [None] * (len(inputs) - 1)
        check_against_reference(
            fn,
            inputs,
            layouts,
            mesh,
            out_layouts=[layout],
            what=what,
        )
    spec = layout.spec(mesh, x)
    rows = from_local_spec(spec.narrow(x).contiguous(), spec)
    with count_traffic() as traffic:
        aten.addmm.default(bias, rows, w)
    assert_all_ranks(traffic.sent == traffic.received == 0, f"{name}: {traffic.as_dict()}")


@pytest.mark.parametrize("name", list(ROW_LAYOUTS))
def test_a_row_sharded_product_keeps_its_rows(name: str) -> None:
    """Values, gradients of rows, matrix and bias, the output's layout and no traffic."""
    run_on_ranks(math.prod(ROW_LAYOUTS[name][0]), _row_sharded_products_body, name)


# ---------------------------------------------------------------------------- flatten then split
# A view that flattens a sharded dim with the dims after it and splits the result again,
# ``(L, B, E) -> (L, B * heads, E / heads)`` as ``F.multi_head_attention_forward`` does,
# keeps the dim sharded (it replicated it): the head dim's shards, times the flattened
# extent, split into whole output rows, boundaries moved to the nearest such rows first.
SPLIT_VIEWS = {  # name: (mesh, input shape, its layout, output shape, the output's layout)
    "2x2 tokens and batch": (
        (2, 2), (12, 3, 8),
        Layout((Shard(1), Shard(0)), {0: (5, 7), 1: (2, 1)}),
        (12, 6, 4), Layout((Shard(1), Shard(0)), {0: (5, 7), 1: (4, 2)}),
    ),
    "4r empty shard": (
        (4,), (2, 4, 8), Layout((Shard(1),), {1: (0, 2, 1, 1)}),
        (2, 16, 2), Layout((Shard(1),), {1: (0, 8, 4, 4)}),
    ),
    "2r boundaries moved": (
        (2,), (3, 6, 2), Layout((Shard(1),), {1: (4, 2)}),
        (3, 2, 6), Layout((Shard(1),), {1: (1, 1)}),
    ),
}  # fmt: skip


def _split_view_body(name: str) -> None:
    mesh_shape, shape, layout, out_shape, out_layout = SPLIT_VIEWS[name]
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64)
    check_against_reference(
        lambda t: t.view(out_shape) * 2, [x], [layout], get_mesh(mesh_shape),
        out_layouts=[out_layout], what=name,
    )  # fmt: skip


@pytest.mark.parametrize("name", list(SPLIT_VIEWS))
def test_a_flatten_then_split_keeps_the_sharded_dim(name: str) -> None:
    """Values, gradient and the output's placements and shard sizes against one process."""
    run_on_ranks(math.prod(SPLIT_VIEWS[name][0]), _split_view_body, name)
