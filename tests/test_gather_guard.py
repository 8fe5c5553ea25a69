"""The gather guard (NOTE [Gathers an op was not asked to make]): every kind of gather an op
makes as its fallback is refused under ``"error"`` on every rank before any collective, said
once per op and call site under ``"warn"``, and recorded with its op, module, call site and
bytes; what the user asks for is never refused; the policy nests, restores and is read from
``SHARDSCI_GATHER``.

The zoo's models run under ``"error"`` in ``test_zoo_sharded`` (grid models) and here
(MeshGraphNet).
"""

from __future__ import annotations

import inspect
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from shardsci import (
    GatherError,
    GatherWarning,
    ShardTensor,
    attention_exchange,
    distribute_tensor,
    gather_policy,
    record_gathers,
)
from shardsci.planning import RunPlan, format_plan
from shardsci.planning._observe import StepObserver
from shardsci.planning._plan import layer_plans
from shardsci.tensor import _dispatch, _function_dispatch, _gather_guard, _torch_compat
from shardsci.tensor._api import from_local_spec
from shardsci.tensor._spec import ShardTensorSpec
from shardsci.testing import (
    assert_all_ranks,
    assert_close_all_ranks,
    assert_raises_all_ranks,
    count_traffic,
    counted_comm,
    get_mesh,
    run_on_ranks,
)

# (B, C, H, W) = (2, 4, 12, 6), H sharded; on 4 ranks one shard is empty.
H_SIZES = {2: (7, 5), 4: (5, 0, 4, 3)}
SHAPE = (2, 4, 12, 6)


def _marked_line(function: object, marker: str) -> int:
    """The line of ``function``'s source that ends with the comment ``# marker``."""
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if line.rstrip().endswith(f"# {marker}"))


def _field(world: int, requires_grad: bool = False) -> tuple[torch.Tensor, ShardTensor]:
    """The whole field (every rank draws the same) and its H-sharded ShardTensor."""
    torch.manual_seed(0)
    whole = torch.randn(SHAPE, dtype=torch.float64)
    x = distribute_tensor(whole, get_mesh((world,)), [Shard(2)], {0: H_SIZES[world]})
    return whole, x.detach().requires_grad_(requires_grad)


# ---------------------------------------------------------------------------- refused
# Each kind of gather an op makes on its own: a GATHERED op (pairwise distances within one
# point set: every output from every input), with_dims_whole (unbind of a sharded 1-D tensor: its 0-d slices cannot
# stay with their holders), the default path
# replicating a sharded dim (DTensor's rule for sort along it), and a handler that makes a
# sharded dim whole before its kernel (a convolution of sharded input channels, which keeps
# the spatial shards).
GATHERS = {
    "gathered": (lambda x: torch.pdist(x[0, 0]), "aten._pdist_forward"),
    "with_dims_whole": (lambda x: x[0, 0, :, 0].unbind(0)[0], "aten.unbind.int"),
    "default path": (lambda x: torch.sort(x, dim=2).values, "aten.sort.default"),
    "channels made whole": (
        lambda x: F.conv2d(x, torch.ones(3, 4, 1, 1, dtype=x.dtype)),
        "torch.nn.functional.conv2d",
    ),
}


def _refused_body(world: int) -> dict[str, str]:
    whole, x = _field(world)
    inputs = {name: x for name in GATHERS}
    inputs["channels made whole"] = x.redistribute(placements=[Shard(1)])
    messages = {}
    for name, (op, op_name) in GATHERS.items():
        traffic = []

        def attempt(op=op, x=inputs[name], traffic=traffic) -> None:
            with count_traffic() as counted:
                traffic.append(counted)
                op(x)

        with gather_policy("error"):
            error = assert_raises_all_ranks(GatherError, op_name, attempt)
        assert_all_ranks(
            traffic[0].collective_calls == traffic[0].messages == 0,
            f"{name}: {dict(traffic[0].collectives)} ran before the refusal",
        )
        messages[name] = str(error)
    # No rank was left inside a collective: the same ops now run, and agree with one process.
    with gather_policy("allow"):
        for name, (op, _) in GATHERS.items():
            out = op(inputs[name])
            assert_close_all_ranks(out.full_tensor(), op(whole), atol=1e-12, rtol=0, what=name)
    dist.barrier()
    return messages


@pytest.mark.parametrize("world", [2, 4])
def test_each_kind_of_gather_is_refused_on_every_rank_before_its_collective(world: int) -> None:
    results = run_on_ranks(world, _refused_body, world)
    assert all(r == results[0] for r in results), "ranks raised different messages"
    largest = {2: 7, 4: 5}[world]
    for name, message in results[0].items():
        op_name = GATHERS[name][1]
        assert message.startswith(f"shardsci refused a gather (gather policy 'error'): {op_name}")
        assert "SHARDSCI_GATHER" in message and "x.redistribute(...)" in message, message
        assert f"called from {os.path.relpath(__file__)}:" in message, (name, message)
    sort = results[0]["default path"]
    assert "float64 tensor of shape (2, 4, 12, 6) laid out (Shard(2),)" in sort, sort
    assert f"dim 2 in {'/'.join(map(str, H_SIZES[world]))}] into (Replicate(),)" in sort, sort
    # Bytes worked out here: the whole field per rank after, the largest H shard before.
    whole_bytes, before = 2 * 4 * 12 * 6 * 8, 2 * 4 * largest * 6 * 8
    assert f"up to {whole_bytes / 1024:.1f} KiB, up to {before / 1024:.1f} KiB before" in sort


# ---------------------------------------------------------------------------- not refused
def _asked_for_body(mesh_shape: tuple[int, ...]) -> None:
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    whole = torch.randn(SHAPE, dtype=torch.float64)
    blocks = [Shard(2), Shard(3)][: len(mesh_shape)]
    x = distribute_tensor(whole, mesh, blocks)
    replicated = [Replicate()] * len(mesh_shape)
    one = distribute_tensor(torch.tensor([3.0]), mesh, [Shard(0), *replicated[1:]])
    empty = distribute_tensor(torch.zeros(3, 0), mesh, [Shard(0), *replicated[1:]])
    buffer = distribute_tensor(torch.zeros(SHAPE, dtype=torch.float64), mesh, replicated)
    with gather_policy("error"), record_gathers() as gathers:
        x.full_tensor()
        x.redistribute(placements=replicated)
        x.redistribute(placements=[Shard(1)] * len(mesh_shape))  # each rank keeps a share
        _ = x / x.sum(dim=2, keepdim=True)  # a pending sum all-reduced by the default path
        _ = torch.fft.fft2(x)  # transposes of the sharded dims: each rank keeps a share
        value = one.item()  # one value for the whole tensor, asked for
        buffer.copy_(x)  # into a destination the user made whole
        buffer.add_(x)
        empty.unbind(0)  # no elements: nothing to hold
    assert_all_ranks(not gathers, f"counted as gathers: {[g.op for g in gathers]}")
    assert_all_ranks(value == 3.0, f"item() read {value}")
    assert_close_all_ranks(buffer.full_tensor(), 2 * whole, atol=0, rtol=0, what="buffer")


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["2r", "2x2"])
def test_what_the_user_asks_for_is_not_a_gather(mesh_shape: tuple[int, ...]) -> None:
    run_on_ranks(len(mesh_shape) * 2, _asked_for_body, mesh_shape)


# ---------------------------------------------------------------------------- every route
def _routes_body() -> dict[str, list[tuple[str, bool]]]:
    """Every route an op may take runs with that op innermost on the dispatch stack, so any
    redistribution it makes is checked: function handlers (indexing), aten handlers (pdist),
    the pointwise fast path (add of one layout), the default path (sort)."""
    _, x = _field(2)
    seen: dict[str, list[tuple[str, bool]]] = {}

    def watched(route: str, function):
        def run(func, *args, **kwargs):
            innermost = (_gather_guard.dispatching() or [None])[-1]
            seen.setdefault(route, []).append((str(func), innermost is func))
            return function(func, *args, **kwargs)

        return run

    def watched_lookup(route: str, lookup):
        def find(func):
            handler = lookup(func)
            return None if handler is None else watched(route, handler)

        return find

    patches = [
        (_function_dispatch, "function_handler_for", "function handler"),
        (_dispatch, "aten_handler_for", "aten handler"),
        (_dispatch, "_pointwise_fast_path", "fast path"),
        (_dispatch, "run_with_propagation", "default path"),
    ]
    originals = [getattr(module, name) for module, name, _ in patches]
    for (module, name, route), original in zip(patches, originals):
        wrap = watched_lookup if name.endswith("handler_for") else watched
        setattr(module, name, wrap(route, original))
    _dispatch._ROUTES.clear()  # routes cache the aten handler looked up
    try:
        # pdist and a sort along the split dim gather, chosen for their routes: what is
        # checked here is the dispatch stack, not the policy.
        with gather_policy("allow"):
            torch.pdist(x[0, 0])
            _ = x + x
            torch.sort(x, dim=2)
    finally:
        for (module, name, _), original in zip(patches, originals):
            setattr(module, name, original)
        _dispatch._ROUTES.clear()
    return seen


def test_every_route_of_an_op_runs_with_the_op_on_the_dispatch_stack() -> None:
    seen = run_on_ranks(2, _routes_body)[0]
    assert set(seen) == {"function handler", "aten handler", "fast path", "default path"}, seen
    missing = {route: [f for f, ok in calls if not ok] for route, calls in seen.items()}
    assert not any(missing.values()), f"routes run without their op on the stack: {missing}"
    assert ("aten._pdist_forward.default", True) in seen["aten handler"], seen
    assert ("aten.add.Tensor", True) in seen["fast path"], seen


# ---------------------------------------------------------------------------- warned, recorded
class _Sorter(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sort(x, dim=2).values  # sorts


_SORT_LINE = _marked_line(_Sorter.forward, "sorts")


def _warned_body() -> list[tuple[str, int, str]]:
    _, x = _field(2)
    _gather_guard.forget_warnings()
    with warnings.catch_warnings(record=True) as caught, gather_policy("warn"):
        warnings.simplefilter("always")
        for _ in range(3):
            torch.sort(x, dim=2)  # site 1
        torch.sort(x, dim=2)  # site 2
        x[0, 0, :, 0].unbind(0)  # site 3
        with gather_policy("allow"):
            x[0, 0, :, 0].unbind(0)
    return [(str(w.message), w.lineno, w.category.__name__) for w in caught]


def test_warn_says_once_per_op_and_call_site() -> None:
    results = run_on_ranks(2, _warned_body)
    assert results[0] == results[1]
    assert [(line, category) for _, line, category in results[0]] == [
        (_marked_line(_warned_body, f"site {n}"), "GatherWarning") for n in (1, 2, 3)
    ]
    first = results[0][0][0]
    assert first.startswith("shardsci: aten.sort.default gathered a float64 tensor"), first
    assert "Said once per op and call site" in first


def _reports_built_body() -> int:
    _, x = _field(2)
    _gather_guard.forget_warnings()
    built = []
    module_path = _gather_guard._module_path
    _gather_guard._module_path = lambda frame: built.append(frame) or module_path(frame)
    try:
        with warnings.catch_warnings(), gather_policy("warn"):
            warnings.simplefilter("ignore")
            for _ in range(3):
                torch.sort(x, dim=2)
    finally:
        _gather_guard._module_path = module_path
    return len(built)


def test_warn_builds_a_report_once_per_op_and_call_site() -> None:
    """A step repeats its gathers (attention's keys and values under the default policy):
    one said already costs no report (whose module path searches every running module)."""
    assert run_on_ranks(2, _reports_built_body) == [1, 1]


def _recorded_body() -> list:
    whole, x = _field(2, requires_grad=True)
    model = nn.Sequential(nn.Identity(), _Sorter())
    with gather_policy("allow"), record_gathers() as gathers:
        y = torch.pdist(model(x.detach())[0, 0] - x[0, 1])
        y.sum().backward()
    expected = torch.pdist(model(whole)[0, 0] - whole[0, 1])
    assert_close_all_ranks(y.full_tensor(), expected, atol=1e-12, rtol=0, what="pdist")
    return [
        (g.op, g.module, g.backward_of, g.call_site, g.total_bytes, g.bytes_per_rank_before)
        for g in gathers
    ]


def test_records_name_the_op_module_backward_and_bytes() -> None:
    records = run_on_ranks(2, _recorded_body)
    assert records[0] == records[1]
    sort, *pdist = records[0]
    field_bytes = 2 * 4 * 12 * 6 * 8
    assert sort == (
        "aten.sort.default",
        "Sequential.1 (_Sorter)",
        None,
        f"{os.path.relpath(__file__)}:{_SORT_LINE}",
        field_bytes,
        field_bytes * 7 // 12,  # the larger H shard
    )
    # pdist's operand (12, 6), split by rows as x[0, 1], is gathered forward and in its backward.
    assert [(r[0], r[2]) for r in pdist] == [
        ("aten._pdist_forward.default", None),
        ("aten._pdist_backward.default", "PdistBackward0"),
    ], pdist
    assert all(r[1] is None and r[4] == 12 * 6 * 8 for r in pdist), pdist


# ---------------------------------------------------------------------------- the dry run
class _Distances(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.pdist(a - b)


class _SortedDistances(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sort = _Sorter()
        self.distances = _Distances()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.distances(self.sort(x)[0, 0], x[0, 1])


def _listed_body() -> tuple[dict[str, list[str]], str]:
    _, x = _field(2, requires_grad=True)
    model = _SortedDistances()
    observer = StepObserver(model)
    with gather_policy("allow"), observer.watching():
        model(x).sum().backward()
    layers = layer_plans(observer)
    plan = RunPlan("-", "2", "domain", 2, "-", 0, 1, [], layers, None, [], [])
    return {layer.name: layer.gathers for layer in layers}, format_plan(plan)


@pytest.mark.xfail(
    _torch_compat.torch_release() < (2, 13),
    reason="torch 2.11 and 2.12: the backward gather of aten._pdist_backward is filed under "
    "'(outside the model)' instead of its layer (cause not found yet)",
    strict=True,
)
def test_the_dry_run_lists_gathers_per_layer() -> None:
    """The dry run's observer puts each gather in its layer and pass, backward included, and
    its report lists them (NOTE [How a dry run observes the library])."""
    gathers, report = run_on_ranks(2, _listed_body)[0]
    field = "float64 (2, 4, 12, 6) [0: S(2)] d2=7,5 -> [0: R] x1, 4608 B per rank"
    rows = "float64 (12, 6) [0: S(0)] d0=7,5 -> [0: R]"
    assert gathers == {
        "(model)": [],
        "sort": [f"forward: aten.sort.default gathered {field}"],
        "distances": [
            f"forward: aten._pdist_forward.default gathered {rows} x1, 576 B per rank",
            f"backward: aten._pdist_backward.default gathered {rows} x1, 576 B per rank",
        ],
    }, gathers
    assert (
        "gathers: 3 kind(s) of gather an op made without being asked; "
        "shardsci.gather_policy('error') or SHARDSCI_GATHER=error refuses them:\n"
        f"  sort (_Sorter): forward: aten.sort.default gathered {field}\n"
    ) in report, report


# ---------------------------------------------------------------------------- attention
def _attention_body() -> list[str]:
    mesh = get_mesh((2,))
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 10, 4, dtype=torch.float64) for _ in range(3))
    sharded = [distribute_tensor(t, mesh, [Shard(2)], {0: (6, 4)}) for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(q, k, v)
    _gather_guard.forget_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for policy, exchange in [("error", "auto"), ("error", "all_gather"), ("warn", "auto")]:
            with gather_policy(policy), attention_exchange(exchange), counted_comm() as stats:
                out = F.scaled_dot_product_attention(*sharded)
            # The ring's hops are counted as "p2p" (on gloo one all-to-all each, as the
            # all-gather of uneven blocks is: count_traffic cannot tell them apart on 2 ranks).
            ring = "p2p" in stats.calls
            assert_all_ranks(
                ring == (policy == "error" and exchange == "auto"),
                f"{policy}, {exchange}: {stats.as_dict()}",
            )
            assert_close_all_ranks(out.full_tensor(), expected, atol=1e-12, rtol=0, what=policy)
    return [str(w.message) for w in caught if w.category is GatherWarning]


def test_attention_takes_the_ring_rather_than_gather_under_error() -> None:
    """``"auto"`` gathers tiny keys and values; under ``"error"`` it takes the ring, an
    explicit ``"all_gather"`` is asked for, and under ``"warn"`` the gather is said."""
    (messages, _) = run_on_ranks(2, _attention_body)
    assert len(messages) == 1, messages
    assert messages[0].startswith(
        "shardsci: torch.nn.functional.scaled_dot_product_attention gathered the keys and values"
    ), messages[0]


def _product_body() -> list[str]:
    """``q @ k^T`` with the tokens of both sharded: the moving operand is tiny, so ``"auto"``
    would gather it whole."""
    mesh = get_mesh((2,))
    torch.manual_seed(0)
    q, k = (torch.randn(2, 10, 4, dtype=torch.float64) for _ in range(2))
    sq, sk = (distribute_tensor(t, mesh, [Shard(1)], {0: (6, 4)}) for t in (q, k))
    _gather_guard.forget_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for policy in ("error", "warn"):
            with gather_policy(policy), counted_comm() as stats:
                out = sq @ sk.transpose(-2, -1)
            assert_all_ranks(
                ("p2p" in stats.calls) == (policy == "error"),
                f"{policy}: {stats.as_dict()}",
            )
            assert_close_all_ranks(
                out.full_tensor(), q @ k.transpose(-2, -1), atol=1e-12, rtol=0, what=policy
            )
    return [str(w.message) for w in caught if w.category is GatherWarning]


def test_a_product_of_token_sharded_operands_takes_the_ring_under_error() -> None:
    """The product's automatic exchange asks the guard as attention's does: the ring under
    ``"error"``, the gather said under ``"warn"``."""
    (messages, _) = run_on_ranks(2, _product_body)
    assert len(messages) == 1, messages
    assert "gathered the moving operand of a product" in messages[0], messages[0]


# ---------------------------------------------------------------------------- the zoo
def _mesh_graph_net_body(parts: str, aggregation: str, batch: int) -> None:
    from tests.test_meshgraphnet import _sharded_body

    with gather_policy("error"):
        _sharded_body(parts, aggregation, batch)


@pytest.mark.parametrize(("parts", "world"), [("metis-2", 2), ("rcb-empty", 4)])
def test_mesh_graph_net_gathers_nothing(parts: str, world: int) -> None:
    run_on_ranks(world, _mesh_graph_net_body, parts, "max", 2)


# ---------------------------------------------------------------------------- the policy
def test_policy_nests_and_restores() -> None:
    before = gather_policy.current()
    with gather_policy("error"):
        assert gather_policy.current() == "error"
        with pytest.raises(KeyError), gather_policy("allow"):
            assert gather_policy.current() == "allow"
            raise KeyError
        assert gather_policy.current() == "error"
    assert gather_policy.current() == before
    gather_policy("allow")  # a global setting
    try:
        assert gather_policy.current() == "allow"
    finally:
        gather_policy(before)
    with pytest.raises(ValueError, match=r"gather_policy's mode must be 'allow', 'warn' or 'err"):
        gather_policy("refuse")  # type: ignore[arg-type]
    assert gather_policy.current() == before


def test_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, policy in [("", "warn"), ("error", "error"), (" Allow ", "allow")]:
        monkeypatch.setenv("SHARDSCI_GATHER", value)
        assert _gather_guard._from_environment() == policy
    monkeypatch.setenv("SHARDSCI_GATHER", "strict")
    with pytest.raises(ValueError, match=r"variable SHARDSCI_GATHER must be .* got 'strict'"):
        _gather_guard._from_environment()
    # And at import, in a fresh process.
    code = "import shardsci; print(shardsci.gather_policy.current())"
    env = {**os.environ, "SHARDSCI_GATHER": "error"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "error"


# ---------------------------------------------------------------------------- the default path
def _reduced_first_body(mesh_shape: tuple[int, ...]) -> None:
    """NOTE [A pending sum is reduced rather than an operand gathered]."""
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    whole = torch.randn(SHAPE, dtype=torch.float64, requires_grad=True)
    sizes = {0: (7, 5)} if len(mesh_shape) == 1 else {0: (8, 4), 1: (2, 4)}
    placements = [Shard(2), Shard(3)][: len(mesh_shape)]
    x = distribute_tensor(whole.detach(), mesh, placements, sizes).requires_grad_()
    patterns = {
        "x * sum": lambda t: t * t.sum(2, keepdim=True),
        "x - mean": lambda t: t - t.mean(2, keepdim=True),
        "x * amax": lambda t: t * t.amax(2, keepdim=True),
    }
    # Measured, not judged by the guard: no collective brings a rank as many bytes as its
    # own shard of the field (the statistics' all-reduces are a row each), where a pending sum
    # expanded over the field in the backward and reduce-scattered into x's shards brought
    # each rank its whole shard.
    shard = x._local.numel() * x._local.element_size()
    for name, pattern in patterns.items():
        with gather_policy("error"), count_traffic() as traffic:
            out = pattern(x)
            (grad,) = torch.autograd.grad(out.square().sum(), x)
        largest = traffic.largest_received
        assert_all_ranks(largest < shard, f"{name}: received {largest} at once, a shard is {shard}")
        expected = pattern(whole)
        (expected_grad,) = torch.autograd.grad(expected.square().sum(), whole)
        assert_all_ranks(out.spec.same_layout(x.spec.with_dtype(out.dtype)), f"{name}: {out.spec}")
        assert_close_all_ranks(out.full_tensor(), expected, atol=1e-12, rtol=0, what=name)
        assert_close_all_ranks(grad.full_tensor(), expected_grad, atol=1e-12, rtol=0, what=name)


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["2r", "2x2"])
def test_a_pending_sum_is_reduced_rather_than_an_operand_gathered(
    mesh_shape: tuple[int, ...],
) -> None:
    run_on_ranks(len(mesh_shape) * 2, _reduced_first_body, mesh_shape)


# A pending sum broadcast by a pointwise op: (B, C, W) = (6, 5, 4) split along B (and C, W);
# the sum over B, (1, 5, 4), is pending over B's axis (no rank holds B whole). Sizes:
# uneven, an empty shard, 2x2, 2x2x2 with W on one rank.
BROADCAST_LAYOUTS = {
    "2r-uneven": ((2,), {0: (4, 2)}),
    "4r-empty": ((4,), {0: (3, 0, 2, 1)}),
    "2x2": ((2, 2), {0: (3, 3), 1: (2, 3)}),
    "2x2x2-empty": ((2, 2, 2), {0: (4, 2), 1: (2, 3), 2: (0, 4)}),
}


def _broadcast_pending_body(layout: str) -> None:
    """NOTE [A pending sum is reduced rather than an operand gathered]: ``g * x.sum(0, True)``
    with ``g`` replicated (softmax's double backward) reduces the (1, 5, 4) sum first."""
    mesh_shape, sizes = BROADCAST_LAYOUTS[layout]
    mesh = get_mesh(mesh_shape)
    generator = torch.Generator().manual_seed(0)
    x_whole, g_whole = (
        torch.randn(6, 5, 4, dtype=torch.float64, generator=generator) for _ in "xg"
    )
    placements = [Shard(d) for d in range(len(mesh_shape))]
    x = distribute_tensor(x_whole, mesh, placements, sizes).requires_grad_()
    g = distribute_tensor(g_whole, mesh, [Replicate()] * len(mesh_shape)).requires_grad_()
    total = x.square().sum(0, keepdim=True)
    assert_all_ranks(total.spec.partial, f"{layout}: the sum is not pending: {total.spec}")
    small = total._local.numel() * total._local.element_size()
    with gather_policy("error"), count_traffic() as traffic:
        scaled = g * total
        out = x - scaled
    # The output is g's layout narrowed to the sum's shards (a replicated dim 0), nothing
    # pending; its subtraction from x narrows it to x's shards, moving nothing.
    wanted = [Replicate()] + [Shard(d) for d in range(1, len(mesh_shape))]
    assert_all_ranks(list(scaled.spec.placements) == wanted, f"{layout}: {scaled.spec}")
    assert_all_ranks(out.spec.same_layout(x.spec), f"{layout}: {out.spec}, x {x.spec}")
    # At most an all-reduce of this rank's shard of the sum over axis 0 (a ring's 2(n-1)/n of
    # it), where reducing the (6, 5, 4) pending product into x's shards moved more.
    n = mesh_shape[0]
    bound = 2 * (n - 1) * small // n
    kinds = set(traffic.received_by_kind)
    assert_all_ranks(kinds <= {"all_reduce"}, f"{layout}: {dict(traffic.received_by_kind)}")
    assert_all_ranks(traffic.received <= bound, f"{layout}: {traffic.received} B, sum {small}")
    x_leaf, g_leaf = x_whole.clone().requires_grad_(), g_whole.clone().requires_grad_()
    expected = x_leaf - g_leaf * x_leaf.square().sum(0, keepdim=True)
    assert_close_all_ranks(out.full_tensor(), expected, atol=1e-12, rtol=0, what=layout)
    weights = torch.randn(6, 5, 4, dtype=torch.float64, generator=generator)
    (out.full_tensor() * weights).sum().backward()
    (expected * weights).sum().backward()
    assert_all_ranks(x.grad.spec.same_layout(x.spec), f"{layout}: x's gradient {x.grad.spec}")
    for name, got, want in [("x", x.grad, x_leaf.grad), ("g", g.grad, g_leaf.grad)]:
        assert_close_all_ranks(got.full_tensor(), want, atol=1e-12, rtol=0, what=name)


@pytest.mark.parametrize("layout", list(BROADCAST_LAYOUTS))
def test_a_pending_sum_broadcast_by_a_pointwise_op_is_reduced_first(layout: str) -> None:
    run_on_ranks(math.prod(BROADCAST_LAYOUTS[layout][0]), _broadcast_pending_body, layout)


# ---------------------------------------------------------------------------- pending sums
# A pending sum of the whole field (each rank's addend of full extent, Partial) reduced into
# the field's split layout: a reduce-scatter, whose input on every rank is the whole field.
# (B, C, H, W) blocks as in _reduced_first_body; sizes per mesh: even, uneven, one empty.
PENDING_LAYOUTS = {
    "2r-uneven": ((2,), [Shard(2)], {2: (7, 5)}),
    "4r-empty": ((4,), [Shard(2)], {2: (5, 0, 4, 3)}),
    "2x2-blocks": ((2, 2), [Shard(2), Shard(3)], {2: (8, 4), 3: (2, 4)}),
    "2x2x2-nested": ((2, 2, 2), [Shard(2), Shard(3), Shard(2)], {2: (4, 4, 0, 4), 3: (2, 4)}),
}


def _addend(rank: int) -> torch.Tensor:
    return torch.randn(SHAPE, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))


def _pending_sum_body(layout: str) -> dict[str, object]:
    mesh_shape, placements, sizes = PENDING_LAYOUTS[layout]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    whole = torch.randn(SHAPE, dtype=torch.float64, requires_grad=True)
    order = {d: tuple(a for a, p in enumerate(placements) if p.dim == d) for d in sizes}
    spec = ShardTensorSpec.build(mesh, placements, SHAPE, torch.float64, sizes, order=order)
    x = from_local_spec(spec.narrow(whole.detach()), spec).detach().requires_grad_()
    addend = _addend(dist.get_rank()).requires_grad_()
    pending_spec = ShardTensorSpec.build(mesh, [Partial()] * len(mesh_shape), SHAPE, torch.float64)
    total = sum(_addend(r) for r in range(dist.get_world_size()))

    def pending_plus_x() -> ShardTensor:
        return from_local_spec(addend, pending_spec) + x

    # Measured here, not by the guard: each rank's addend is the whole field, and reducing it
    # into x's layout is a collective that sends all but this rank's share of it.
    whole_bytes = addend.numel() * addend.element_size()
    with gather_policy("allow"), record_gathers() as seen, count_traffic() as traffic:
        out = pending_plus_x()
    share = out._local.numel() * out._local.element_size()
    assert_all_ranks(addend.numel() == whole.numel(), "the addend is not the whole field")
    assert_all_ranks(
        traffic.collective_calls >= 1 and traffic.sent >= whole_bytes - share,
        f"{dict(traffic.collectives)}: sent {traffic.sent} of a {whole_bytes}-byte field",
    )
    # The reference: one process, the same global data.
    expected = whole + total
    assert_close_all_ranks(out.full_tensor(), expected, atol=1e-12, rtol=0, what="values")
    assert_all_ranks(out.spec.same_layout(x.spec), f"output {out.spec}, input {x.spec}")
    out.backward(from_local_spec(spec.narrow(torch.ones(SHAPE, dtype=torch.float64)), spec))
    assert_close_all_ranks(x.grad.full_tensor(), torch.ones(SHAPE, dtype=torch.float64),
                           atol=0, rtol=0, what="gradient of x")  # fmt: skip
    assert_close_all_ranks(addend.grad, torch.ones(SHAPE, dtype=torch.float64), atol=0, rtol=0,
                           what="gradient of the addend")  # fmt: skip
    # The guard sees it, with the bytes worked out above; under "error", before the collective.
    noted = [(g.what, g.bytes_per_rank_before) for g in seen]
    assert_all_ranks(noted == [("a pending sum", whole_bytes)], f"recorded {noted}")
    refused = []

    def refused_before_any_collective() -> None:
        with gather_policy("error"), count_traffic() as traffic:
            refused.append(traffic)
            pending_plus_x()

    error = assert_raises_all_ranks(
        GatherError,
        r"aten\.add\.Tensor would reduce a pending sum, held whole",
        refused_before_any_collective,
    )
    calls = refused[0].collective_calls
    assert_all_ranks(calls == 0, f"ran {dict(refused[0].collectives)}")
    return {"message": str(error), "whole": whole_bytes, "share": share}


@pytest.mark.parametrize("layout", list(PENDING_LAYOUTS))
def test_a_pending_sum_held_whole_and_reduce_scattered_counts(layout: str) -> None:
    """NOTE [Gathers an op was not asked to make]: a reduce-scatter of a whole-field pending
    sum held every rank at a gather's memory; the guard says so (failed without the rule)."""
    mesh_shape = PENDING_LAYOUTS[layout][0]
    results = run_on_ranks(math.prod(mesh_shape), _pending_sum_body, layout)
    assert len({r["message"] for r in results}) == 1, "ranks raised different messages"
    assert "laid out (Partial(sum)" in results[0]["message"], results[0]["message"]


# ---------------------------------------------------------------------------- pending results
# An op whose own output is a pending sum each rank holds whole: a dense operator applied
# along the sharded dim (``A @ x``, ``A`` plain (H, H)) contracts H, and every rank's partial
# product is the field's whole extent along H. Nothing may ever reduce it into shards (a
# ``full_tensor()`` or a loss all-reduces it), so the guard says so where it is made.
def _pending_result_body(layout: str) -> dict[str, object]:
    mesh_shape, placements, sizes = PENDING_LAYOUTS[layout]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    whole = torch.randn(SHAPE, dtype=torch.float64, requires_grad=True)
    operator = torch.randn(SHAPE[2], SHAPE[2], dtype=torch.float64, requires_grad=True)
    order = {d: tuple(a for a, p in enumerate(placements) if p.dim == d) for d in sizes}
    spec = ShardTensorSpec.build(mesh, placements, SHAPE, torch.float64, sizes, order=order)
    x = from_local_spec(spec.narrow(whole.detach()), spec).detach().requires_grad_()
    with gather_policy("allow"), record_gathers() as seen:
        out = torch.matmul(operator, x)
        reductions = [x.sum(2), x * x.sum(2, keepdim=True), x.sum()]
    # Measured on the shards, not by the guard: each rank holds more than its share of x, as
    # much as x gathered along H (the axes sharding W, if any, still split it).
    held = torch.tensor(out._local.numel() * out._local.element_size())
    share = x._local.numel() * x._local.element_size()
    dist.all_reduce(held, dist.ReduceOp.MAX)
    assert_all_ranks(out._local.numel() > x._local.numel(), f"holds {out._local.shape}")
    expected = operator @ whole
    assert_close_all_ranks(out.full_tensor(), expected, atol=1e-12, rtol=0, what="values")
    (grad,) = torch.autograd.grad(out.full_tensor().square().sum(), x)
    (expected_grad,) = torch.autograd.grad(expected.square().sum(), whole)
    assert_close_all_ranks(grad.full_tensor(), expected_grad, atol=1e-12, rtol=0, what="grad")
    noted = [(g.op, g.what, g.bytes_per_rank) for g in seen]
    wanted = [("torch.matmul", "a pending result", int(held))]
    assert_all_ranks(noted == wanted, f"recorded {noted}, expected {wanted} (reductions: none)")
    assert_all_ranks(all(r.spec.partial or r.spec.shardings for r in reductions), "reductions")

    def refused() -> None:
        with gather_policy("error"):
            torch.matmul(operator, x)

    error = assert_raises_all_ranks(
        GatherError,
        r"torch\.matmul would make a pending sum, held whole, from a float64 tensor",
        refused,
    )
    return {"message": str(error), "held": int(held), "share": share}


@pytest.mark.parametrize("layout", list(PENDING_LAYOUTS))
def test_a_pending_result_held_whole_counts_where_it_is_made(layout: str) -> None:
    """NOTE [Gathers an op was not asked to make]: ``A @ x`` contracting x's sharded dim
    leaves every rank a pending sum as large as x gathered over that axis; the guard records
    it with the bytes measured on the shards and refuses it on every rank under "error"."""
    mesh_shape = PENDING_LAYOUTS[layout][0]
    results = run_on_ranks(math.prod(mesh_shape), _pending_result_body, layout)
    assert len({r["message"] for r in results}) == 1, "ranks raised different messages"
    assert all(r["held"] > r["share"] for r in results), results


# A backward formula that builds its input's gradient as a plain tensor of the global shape
# (``zeros(sizes)`` scattered into, as ``max_pool2d_with_indices_backward``'s does): every rank
# holds the whole gradient before the backward of ``from_local`` slices it; no collective, so
# only that backward can say it. A ZeroTensor gradient (``sgn``'s) holds no storage.
class _GradientBuiltWhole(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        ctx.shape = x.shape
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return torch.full(ctx.shape, 2.0, dtype=torch.float64)


def _built_whole_body(world: int) -> dict[str, object]:
    whole, field = _field(world)
    spec = field._spec
    local = field._local.detach().requires_grad_()
    x = from_local_spec(local, spec)
    with gather_policy("allow"), record_gathers() as seen:
        _GradientBuiltWhole.apply(x).sum().full_tensor().backward()
        x.sgn().sum().full_tensor().backward()
    expected = spec.narrow(torch.full(SHAPE, 2.0, dtype=torch.float64))
    assert_close_all_ranks(local.grad, expected, atol=0, rtol=0, what="gradient")
    noted = [(g.what, g.op, g.bytes_per_rank, g.bytes_per_rank_before) for g in seen]
    wanted = [("a gradient built whole", "a backward formula", whole.numel() * 8, None)]
    assert_all_ranks(
        len(noted) == 1 and noted[0][:3] == wanted[0][:3], f"recorded {noted}, expected {wanted}"
    )
    loss = _GradientBuiltWhole.apply(from_local_spec(local, spec)).sum().full_tensor()

    def refused() -> None:
        with gather_policy("error"):
            loss.backward()

    error = assert_raises_all_ranks(
        GatherError, r"a backward formula would build a gradient whole, a float64 tensor", refused
    )
    return {"message": str(error), "before": noted[0][3]}


@pytest.mark.parametrize("world", [2, 4])
def test_a_gradient_built_whole_by_a_backward_formula_counts(world: int) -> None:
    """NOTE [Gathers an op was not asked to make]: a gradient built plain at the global shape
    of a sharded tensor is recorded with its bytes and refused on every rank under "error";
    a ZeroTensor gradient is not."""
    results = run_on_ranks(world, _built_whole_body, world)
    assert len({r["message"] for r in results}) == 1, "ranks raised different messages"
    largest = {2: 7, 4: 5}[world]
    assert results[0]["before"] == 2 * 4 * largest * 6 * 8, results[0]
    assert "in the backward of _FromLocalBackward" in results[0]["message"], results[0]
