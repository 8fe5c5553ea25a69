"""``F.scaled_dot_product_attention`` with a sharded sequence, against the single-process
reference in float64: ring and all-gather exchanges, uneven and empty shards, 1-D and 2-D
meshes, causal, boolean and additive masks (with their gradient), grouped-query attention,
cross-attention, batch and head shardings; the bytes each exchange moves (the ring's bound,
NOTE [Ring attention]); the cost rule; ``nn.MultiheadAttention``; refused dropout.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from shardsci import GatherWarning, attention_exchange
from shardsci.tensor import _gather_guard
from shardsci.tensor._api import from_local_spec
from shardsci.tensor._ops import _attention_ops
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    assert_raises_all_ranks,
    check_against_reference,
    count_traffic,
    counted_comm,
    get_mesh,
    run_on_ranks,
)
from tests.exchange_ways import exchanges_as
from tests.layouts import Sharded

# (B, H, L, E) queries (and keys, values) with the sequence dim L = 2 sharded.
CASES = [
    Sharded("2r-7/4", (2,), (2, 3, 11, 4), Layout((Shard(2),), {2: (7, 4)})),
    Sharded("4r-3/0/5/3", (4,), (2, 3, 11, 4), Layout((Shard(2),), {2: (3, 0, 5, 3)})),
    Sharded(
        "2x2-batch-and-L",
        (2, 2),
        (2, 3, 11, 4),
        Layout((Shard(0), Shard(2)), {0: (1, 1), 2: (6, 5)}),
    ),
    Sharded("2x2-nested-L", (2, 2), (2, 3, 11, 4), Layout((Shard(2), Shard(2)), {2: (2, 4, 0, 5)})),
]
# The sequence split between no ranks (one rank; an axis of size 1 beside a sharded batch).
UNSPLIT = [
    Sharded("1r-L", (1,), (2, 3, 11, 4), Layout((Shard(2),), {2: (11,)})),
    Sharded(
        "2x1-batch-and-L",
        (2, 1),
        (2, 3, 11, 4),
        Layout((Shard(0), Shard(2)), {0: (1, 1), 2: (11,)}),
    ),
]
CASE_BY_NAME = {c.name: c for c in CASES + UNSPLIT}

# Why attention may receive as many bytes as a gather of its keys and values.
EVERY_KEY = "every query attends to every key: each rank receives all keys and values it lacks"

# name -> (SDPA keyword arguments, mask: None, "bool", "float", "float-grad", "padding")
VARIANTS = {
    "plain": ({}, None),
    "causal": ({"is_causal": True}, None),
    "bool-mask": ({}, "bool"),
    "additive-mask": ({"scale": 0.7}, "float"),
    "learned-bias": ({}, "float-grad"),
    "key-padding": ({}, "padding"),
    "gqa-causal": ({"enable_gqa": True, "is_causal": True}, None),
}


def _mask(kind: str | None, shape: tuple[int, ...]) -> tuple[torch.Tensor | None, bool]:
    """A mask for the (B, H, L, L) scores of ``shape`` (B, H, L, E) queries, and whether it is
    passed sharded like the queries."""
    batch, _, length, _ = shape
    keys = length
    if kind == "bool":
        mask = torch.rand(length, keys) > 0.4
        mask[3] = False  # a row that sees no key: output 0, as in torch
        return mask, False
    if kind == "float":
        return torch.randn(batch, 1, length, keys, dtype=torch.float64), False
    if kind == "float-grad":
        return torch.randn(1, 3, length, keys, dtype=torch.float64), True
    if kind == "padding":
        return torch.rand(batch, 1, 1, keys) > 0.3, False
    return None, False


def _sdpa_body(case_name: str, variant: str, mode: str) -> None:
    case = CASE_BY_NAME[case_name]
    mesh = get_mesh(case.mesh)
    kwargs, mask_kind = VARIANTS[variant]
    shape = case.shape
    heads = 6 if kwargs.get("enable_gqa") else shape[1]
    q = torch.randn(shape[0], heads, *shape[2:], dtype=torch.float64)
    k = torch.randn(shape, dtype=torch.float64)
    v = torch.randn(*shape[:-1], 5, dtype=torch.float64)
    mask, mask_sharded = _mask(mask_kind, shape)
    inputs, layouts = [q, k, v], [case.layout] * 3
    if mask is not None:
        inputs.append(mask)
        sequence = {2: case.layout.sizes[2]}
        placements = tuple(p if p == Shard(2) else Replicate() for p in case.layout.placements)
        layouts.append(
            Layout(placements, sequence, dict(case.layout.order)) if mask_sharded else None
        )

    def attention(query, key, value, *mask):
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask[0] if mask else None, **kwargs
        )

    with attention_exchange(mode):
        check_against_reference(
            attention,
            inputs,
            layouts,
            mesh,
            out_layouts=[case.layout],  # the queries' layout, with the values' feature width
            not_a_gather=EVERY_KEY,
            what=variant,
        )


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sharded_sequence(case: Sharded, variant: str) -> None:
    run_on_ranks(case.world, _sdpa_body, case.name, variant, "ring")


@pytest.mark.parametrize("case", CASES[1:2], ids=str)
@pytest.mark.parametrize("variant", ["causal", "learned-bias", "gqa-causal"])
def test_sharded_sequence_all_gather(case: Sharded, variant: str) -> None:
    run_on_ranks(case.world, _sdpa_body, case.name, variant, "all_gather")


def _sdpa_messages_body(case_name: str, variant: str) -> None:
    with exchanges_as("messages"):
        _sdpa_body(case_name, variant, "ring")


@pytest.mark.parametrize("case", [CASES[1], CASES[3]], ids=str)
@pytest.mark.parametrize("variant", ["causal", "learned-bias"])
def test_sharded_sequence_ring_as_messages(case: Sharded, variant: str) -> None:
    """The ring's hops as point-to-point messages (gloo sends them as all-to-alls: NOTE [An
    exchange of messages as one all-to-all where messages are slow]), as on NCCL."""
    run_on_ranks(case.world, _sdpa_messages_body, case.name, variant)


def _unsplit_body(case_name: str, variant: str) -> None:
    """Every key on this rank: the plan chooses no ring or gather (``ring_chosen``)."""
    with mock.patch.object(
        _attention_ops, "ring_chosen", wraps=_attention_ops.ring_chosen
    ) as chosen:
        _sdpa_body(case_name, variant, "ring")
    assert chosen.call_count == 0, f"{chosen.call_count} ring-or-gather choices, none expected"


@pytest.mark.parametrize("case", UNSPLIT, ids=str)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_unsplit_sequence_plans_no_exchange(case: Sharded, variant: str) -> None:
    run_on_ranks(case.world, _unsplit_body, case.name, variant)


def _planned_once_body() -> None:
    """A training step repeats its attention calls on the same layouts: they are aligned and
    planned on the first (``_layouts``, cached by value), while the ring-or-gather choice is
    asked on every call, so that the gather policy sees every gather."""
    mesh = get_mesh((2,))
    layout = Layout((Shard(2),), {2: (7, 4)})
    x = torch.randn(2, 3, 11, 4, dtype=torch.float64)
    spec = layout.spec(mesh, x)
    mask = torch.randn(1, 3, 11, 11, dtype=torch.float64, requires_grad=True)
    misses, choices = [], []
    with (
        attention_exchange("ring"),
        mock.patch.object(
            _attention_ops, "ring_chosen", wraps=_attention_ops.ring_chosen
        ) as chosen,
    ):
        for _ in range(3):
            before = _attention_ops._layouts.cache_info().misses
            tokens = from_local_spec(spec.narrow(x).requires_grad_(True), spec)
            out = F.scaled_dot_product_attention(tokens, tokens, tokens, attn_mask=mask)
            (out * out).sum().to_local().sum().backward()
            misses.append(_attention_ops._layouts.cache_info().misses - before)
            choices.append(chosen.call_count)
    assert_all_ranks(
        misses[1:] == [0, 0] and choices == [1, 2, 3],
        f"layouts planned per call: {misses}; ring-or-gather choices so far: {choices}",
    )


def test_repeated_calls_plan_layouts_once() -> None:
    run_on_ranks(2, _planned_once_body)


# ---------------------------------------------------------------------------- other layouts
def _layouts_body() -> None:
    mesh = get_mesh((4,))
    q = torch.randn(2, 3, 11, 4, dtype=torch.float64)
    kv = torch.randn(2, 3, 9, 4, dtype=torch.float64)
    queries = Layout((Shard(2),), {2: (3, 0, 5, 3)})

    def attention(query, key, value):
        return F.scaled_dot_product_attention(query, key, value, is_causal=True)

    cases = {
        # Cross-attention: 9 keys in their own uneven sizes, 11 queries.
        "cross": ([q, kv, kv], [queries, Layout((Shard(2),), {2: (2, 2, 0, 5)})] * 1 + [None]),
        # Keys and values whole on every rank (plain tensors): no exchange at all.
        "replicated-keys": ([q, kv, kv], [queries, None, None]),
        # Heads sharded, sequence whole: every rank attends locally.
        "heads": ([q, q, q], [Layout((Shard(1),), {1: (1, 0, 2, 0)})] * 3),
        # Split features stay split; keys and values move from tokens to features.
        "features": ([q, q, q], [Layout((Shard(3),), {3: (1, 1, 2, 0)}), queries, queries]),
        # A 3-D query broadcast against 4-D keys and values, sharded over heads or tokens.
        "broadcast-heads": ([q[0], kv, kv], [Layout((Shard(0),), {0: (1, 0, 2, 0)}), None, None]),
        "broadcast-tokens": (
            [q[0], kv, kv],
            [Layout((Shard(1),), {1: (3, 0, 5, 3)}), Layout((Shard(2),), {2: (2, 2, 0, 5)}), None],
        ),
    }
    # The queries' layout, except: heads and features stay sharded; a broadcast query's dims
    # move one place right.
    outputs = {
        "heads": cases["heads"][1][0],
        "features": cases["features"][1][0],
        "broadcast-heads": cases["heads"][1][0],
    }
    for name, (inputs, layouts) in cases.items():
        with attention_exchange("ring"):
            check_against_reference(
                attention,
                inputs,
                layouts,
                mesh,
                out_layouts=[outputs.get(name, queries)],
                not_a_gather=EVERY_KEY,
                what=name,
            )


def test_cross_attention_replicated_keys_heads_and_features() -> None:
    run_on_ranks(4, _layouts_body)


# ---------------------------------------------------------------------------- features
# (B, H, L, E) queries, keys and values with the feature dim E = 3 split (NOTE [Attention over a
# split feature dim]): 2 ranks uneven, 4 with an empty shard, 2x2 with L split too.
FEATURE_CASES = {
    "2r-3/5": ((2,), Layout((Shard(3),), {3: (3, 5)})),
    "4r-0/3/4/1": ((4,), Layout((Shard(3),), {3: (0, 3, 4, 1)})),
    "2x2-L-and-E": ((2, 2), Layout((Shard(2), Shard(3)), {2: (7, 4), 3: (5, 3)})),
}
FEATURE_VARIANTS = ["plain", "causal", "learned-bias", "gqa-causal"]


def _features_body(name: str, variant: str) -> None:
    """Values, gradients (the learned bias's too) and the output's layout (the queries')
    against one process."""
    mesh_shape, layout = FEATURE_CASES[name]
    mesh = get_mesh(mesh_shape)
    kwargs, mask_kind = VARIANTS[variant]
    batch, heads, length, width = 2, 3, 11, 8
    q = torch.randn(batch, 6 if kwargs.get("enable_gqa") else heads, length, width).double()
    k, v = (torch.randn(batch, heads, length, width, dtype=torch.float64) for _ in range(2))
    mask, _ = _mask(mask_kind, (batch, heads, length, width))
    inputs, layouts = [q, k, v], [layout] * 3
    if mask is not None:
        inputs.append(mask)
        layouts.append(None)

    def attention(query, key, value, *mask):
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask[0] if mask else None, **kwargs
        )

    with attention_exchange("ring"):
        check_against_reference(
            attention,
            inputs,
            layouts,
            mesh,
            out_layouts=[layout],
            not_a_gather=EVERY_KEY,  # where the rows the features move to are the tokens
            what=name,
        )


@pytest.mark.parametrize("variant", FEATURE_VARIANTS)
@pytest.mark.parametrize("name", list(FEATURE_CASES))
def test_split_features_stay_split(name: str, variant: str) -> None:
    run_on_ranks(math.prod(FEATURE_CASES[name][0]), _features_body, name, variant)


def _feature_bytes_body() -> None:
    """Bytes of one call over split features, counted by ``count_traffic``: the split moves to
    the heads (one all-to-all each of q, k and v), attention is local, and the output moves
    back (one all-to-all); the backward moves the output's gradient and the three gradients
    likewise (NOTE [A split feature dim moves to the rows]). A gather of the features would
    receive ``3 B H L (E - E_r)`` elements forward."""
    mesh = get_mesh((4,))
    batch, heads, length, width = 2, 4, 11, 8
    sizes = (0, 3, 4, 1)
    layout = Layout((Shard(3),), {3: sizes})
    tensors = []
    for _ in range(3):
        x = torch.randn(batch, heads, length, width, dtype=torch.float64)
        spec = layout.spec(mesh, x)
        tensors.append(from_local_spec(spec.narrow(x).requires_grad_(True), spec))
    with attention_exchange("ring"), count_traffic() as forward:
        out = F.scaled_dot_product_attention(*tensors, is_causal=True)
    with count_traffic() as backward:
        (out * out).sum().to_local().sum().backward()
    mine = sizes[torch.distributed.get_rank()]
    to_heads = batch * length * (width - mine) * 8  # one head's features this rank lacks
    to_features = batch * (heads - 1) * length * mine * 8  # its features of the other heads
    expected = {
        "forward": ({"all_to_all": 3 * to_heads + to_features}, 4),
        "backward": ({"all_to_all": to_heads + 3 * to_features}, 4),
    }
    got = {
        "forward": (dict(forward.received_by_kind), forward.collective_calls),
        "backward": (dict(backward.received_by_kind), backward.collective_calls),
    }
    assert_all_ranks(got == expected, f"received, collectives {got}; expected {expected}")


def test_split_feature_bytes() -> None:
    run_on_ranks(4, _feature_bytes_body)


# ---------------------------------------------------------------------------- bytes
BYTE_CASES = {"2r": ((7, 4), (2,)), "4r-empty": ((3, 0, 5, 3), (4,)), "2x2": ((2, 4, 0, 5), (2, 2))}


ROW = 2 * 3 * (4 + 5) * 8
"""Bytes of one token of keys and values in ``_byte_inputs``: batch 2, 3 heads, widths 4 + 5."""


def _byte_inputs(name: str) -> list[torch.Tensor]:
    """``(2, 3, L, 4)`` queries and keys and ``(2, 3, L, 5)`` values of ``BYTE_CASES[name]``,
    their sequence split as it says, requiring gradients."""
    sizes, mesh_shape = BYTE_CASES[name]
    mesh = get_mesh(mesh_shape)
    layout = Layout((Shard(2),) * len(mesh_shape), {2: sizes})
    tensors = []
    for last in (4, 4, 5):
        x = torch.randn(2, 3, sum(sizes), last, dtype=torch.float64)
        spec = layout.spec(mesh, x)
        tensors.append(from_local_spec(spec.narrow(x).requires_grad_(True), spec))
    return tensors


def _ring_bytes(name: str, rank: int) -> dict[str, int]:
    """Bytes rank ``rank`` receives by the ring in a causal attention of ``_byte_inputs``,
    forward and backward (NOTE [Ring attention]): every block of keys and values but its own,
    and in the backward those again and every gradient accumulator but its previous
    neighbour's."""
    sizes = BYTE_CASES[name][0]
    lacking = (sum(sizes) - sizes[rank]) * ROW
    previous = (sum(sizes) - sizes[(rank - 1) % len(sizes)]) * ROW
    return {"forward": lacking, "backward": lacking + previous}


def _bytes_body(name: str, mode: str) -> None:
    """Bytes received per rank: the ring's bound (NOTE [Ring attention])."""
    tensors = _byte_inputs(name)
    with attention_exchange(mode), counted_comm() as forward:
        out = F.scaled_dot_product_attention(*tensors, is_causal=True)
    loss = (out * out).sum().to_local().sum()
    with counted_comm() as backward:
        loss.backward()
    me = torch.distributed.get_rank()
    sizes = BYTE_CASES[name][0]
    ring = _ring_bytes(name, me)
    kind = "p2p" if mode == "ring" else "all_gather"
    if mode == "ring":
        expected_backward = {"p2p": ring["backward"]}
    else:
        expected_backward = {"reduce_scatter": (len(sizes) - 1) * sizes[me] * ROW}
    assert_all_ranks(
        dict(forward.received) == {kind: ring["forward"]}
        and {k: v for k, v in backward.received.items() if k != "all_reduce"} == expected_backward,
        f"{name} {mode}: forward {forward.as_dict()}, backward {backward.as_dict()}; expected "
        f"{kind} {ring['forward']} and {expected_backward}",
    )


@pytest.mark.parametrize("mode", ["ring", "all_gather"])
@pytest.mark.parametrize("name", list(BYTE_CASES))
def test_bytes_at_the_ring_bound(name: str, mode: str) -> None:
    run_on_ranks(len(BYTE_CASES[name][0]), _bytes_body, name, mode)


def _hops_body(name: str, way: str | None) -> dict[str, dict[str, object]]:
    """One causal attention by the ring, forward and backward, counted by ``count_traffic``:
    the ring's hops sent ``way`` (None: as the rule has it for gloo)."""
    tensors = _byte_inputs(name)
    with exchanges_as(way) if way else nullcontext(), attention_exchange("ring"):
        with count_traffic() as forward:
            out = F.scaled_dot_product_attention(*tensors, is_causal=True)
        loss = (out * out).sum().to_local().sum()
        with count_traffic() as backward:
            loss.backward()
    return {
        step: {
            "all_to_alls": traffic.collectives["c10d::alltoall_base_"],
            "messages": traffic.messages,
            "received": {k: v for k, v in traffic.received_by_kind.items() if k != "all_reduce"},
            "connected": {
                r for span in traffic.calls_by_span if span.kind != "all_reduce" for r in span.ranks
            },
        }
        for step, traffic in {"forward": forward, "backward": backward}.items()
    }


@pytest.mark.parametrize("name", list(BYTE_CASES))
def test_gloo_ring_hops_are_one_all_to_all_each(name: str) -> None:
    """NOTE [An exchange of messages as one all-to-all where messages are slow]: on gloo (the
    rule as it stands) each hop of the ring, its empty blocks included, is one all-to-all over
    the group that every rank joins, connecting a rank with its two ring neighbours only, the
    ring's bytes and no message: ``N - 1`` hops forward, ``2 (N - 1)`` backward (the blocks
    once more and their gradient accumulators). As messages, the same bytes and no
    all-to-all. Fails if the ring's hops revert to messages on gloo."""
    n = len(BYTE_CASES[name][0])
    for way in (None, "messages"):
        for rank, result in enumerate(run_on_ranks(n, _hops_body, name, way)):
            expected = _ring_bytes(name, rank)
            for step, hops in {"forward": n - 1, "backward": 2 * (n - 1)}.items():
                got = result[step]
                kind = "p2p" if way == "messages" else "all_to_all"
                assert got["received"] == {kind: expected[step]}, (way, rank, step, got)
                assert got["connected"] <= {rank, (rank - 1) % n, (rank + 1) % n}, (way, got)
                if way == "messages":
                    assert got["all_to_alls"] == 0 and got["messages"] > 0, (rank, step, got)
                else:
                    assert (got["all_to_alls"], got["messages"]) == (hops, 0), (rank, step, got)


def _cost_rule_body() -> None:
    """Small keys and values are gathered, and the gather is said (a ``GatherWarning``); above
    the limit (here 0 bytes), the ring, which says nothing (pytest's filter makes a warning an
    error in the ranks)."""
    mesh = get_mesh((2,))
    x = torch.randn(1, 2, 9, 4, dtype=torch.float64)
    layout = Layout((Shard(2),), {2: (5, 4)})
    spec = layout.spec(mesh, x)
    tokens = from_local_spec(spec.narrow(x), spec)
    chosen = {}
    said = {
        "small": pytest.warns(GatherWarning, match="the keys and values"),
        "large": nullcontext(),
    }
    _gather_guard.forget_warnings()
    for name, limit in {"small": 1 << 20, "large": 0}.items():
        with attention_exchange("auto", gather_limit_bytes=limit), counted_comm() as s, said[name]:
            F.scaled_dot_product_attention(tokens, tokens, tokens)
        chosen[name] = set(s.calls)
    assert_all_ranks(
        chosen == {"small": {"all_gather"}, "large": {"p2p"}}, f"exchanges chosen: {chosen}"
    )


def test_cost_rule() -> None:
    run_on_ranks(2, _cost_rule_body)


# ---------------------------------------------------------------------------- no rank has any
# A sequence empty on every rank: every block is empty, so no hop of the ring moves anything.
NOBODY = {"2r": (2,), "2x2": (2, 2)}


def _nobody_body(name: str) -> dict[str, dict[str, tuple]]:
    """Values, gradients and the output's layout against one process (self- and causal
    attention over no tokens; 11 queries split as usual over no keys: zeros, as torch gives),
    then one causal call's collectives, bytes and messages counted by ``count_traffic``, the
    hops sent as the rule has it for gloo and as messages. A ``GatherWarning`` fails it:
    pytest's filter reaches the ranks."""
    mesh_shape = NOBODY[name]
    mesh = get_mesh(mesh_shape)
    n = math.prod(mesh_shape)
    nothing = Layout((Shard(2),) * len(mesh_shape), {2: (0,) * n})
    queries = Layout((Shard(2),) * len(mesh_shape), {2: (7, 4) if n == 2 else (2, 4, 0, 5)})
    q, k, v = (torch.randn(2, 3, 0, width, dtype=torch.float64) for width in (4, 4, 5))
    cases = {
        "plain": ({}, [q, k, v], nothing),
        "causal": ({"is_causal": True}, [q, k, v], nothing),
        "no keys": ({}, [torch.randn(2, 3, 11, 4, dtype=torch.float64), k, v], queries),
    }
    for mode in ("ring", "all_gather"):
        for what, (kwargs, inputs, out) in cases.items():
            with attention_exchange(mode):
                check_against_reference(
                    lambda *qkv, kwargs=kwargs: F.scaled_dot_product_attention(*qkv, **kwargs),
                    inputs,
                    [out, nothing, nothing],
                    mesh,
                    out_layouts=[out],
                    what=f"{name} {mode} {what}",
                )
    counted = {}
    for way in (None, "messages"):
        tensors = [
            from_local_spec(x.requires_grad_(True), nothing.spec(mesh, x)) for x in (q, k, v)
        ]
        with exchanges_as(way) if way else nullcontext(), attention_exchange("ring"):
            with count_traffic() as forward:
                out = F.scaled_dot_product_attention(*tensors, is_causal=True)
            with count_traffic() as backward:
                (out * out).sum().to_local().sum().backward()
        counted[way or "rule"] = {
            step: (dict(t.collectives), t.received, t.messages)
            for step, t in {"forward": forward, "backward": backward}.items()
        }
    return counted


@pytest.mark.parametrize("name", list(NOBODY))
def test_a_sequence_no_rank_has(name: str) -> None:
    """Equal to one process with empty outputs of the queries' layout, by the ring and the
    all-gather, and no hang; the ring makes no hop in which no block moves (``Blocks.any_moves``:
    before, each hop was an empty all-to-all on gloo), messages or all-to-alls, as the
    all-gather of nothing makes no collective."""
    n = math.prod(NOBODY[name])
    nothing = {step: ({}, 0, 0) for step in ("forward", "backward")}
    for counted in run_on_ranks(n, _nobody_body, name):
        assert counted == {"rule": nothing, "messages": nothing}, counted


# ---------------------------------------------------------------------------- modules, errors
def _multihead_body(batch_first: bool) -> None:
    mesh = get_mesh((4,))
    module = nn.MultiheadAttention(8, 2, batch_first=batch_first).double()
    dim = 1 if batch_first else 0
    x = torch.randn(2, 11, 8, dtype=torch.float64)
    if not batch_first:
        x = x.transpose(0, 1).contiguous()
    layout = Layout((Shard(dim),), {dim: (3, 0, 5, 3)})
    with attention_exchange("ring"):
        check_against_reference(
            lambda m, a: m(a, a, a, need_weights=False)[0],
            [x],
            [layout],
            mesh,
            module=module,
            not_a_gather=EVERY_KEY,
        )


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention(batch_first: bool) -> None:
    run_on_ranks(4, _multihead_body, batch_first)


# Queries (L, N, E = 8) with L split (fewer tokens than ranks in two), attending to a whole
# memory of S = 9 tokens: mesh, layout, L.
WEIGHTS_CASES = {
    "2r-7/4": ((2,), Layout((Shard(0),), {0: (7, 4)}), 11),
    "4r-0/1/1/1": ((4,), Layout((Shard(0),), {0: (0, 1, 1, 1)}), 3),
    "2x2-nested-L": ((2, 2), Layout((Shard(0), Shard(0)), {0: (0, 1, 1, 1)}), 3),
}


def _multihead_weights_body(name: str) -> None:
    """``need_weights=True`` with an additive mask: ``F.multi_head_attention_forward`` computes
    the scores itself by ``baddbmm`` below ``__torch_function__``. The output keeps the
    queries' layout and the weights (N, L, S) their rows, values and every gradient as one
    process, and the forward moves no byte (``count_traffic``): queries' rows against a
    whole memory need nothing from another rank (DTensor's bmm rule, which shards no dim over
    more ranks than it has cells, gathered the rows)."""
    mesh_shape, layout, length = WEIGHTS_CASES[name]
    mesh = get_mesh(mesh_shape)
    module = nn.MultiheadAttention(8, 2).double()
    x = torch.randn(length, 2, 8, dtype=torch.float64)
    memory = torch.randn(9, 2, 8, dtype=torch.float64)
    mask = torch.randn(length, 9, dtype=torch.float64)
    weights = Layout((Shard(1),) * len(mesh_shape), {1: layout.sizes[0]})
    check_against_reference(
        lambda m, q, kv, bias: m(q, kv, kv, need_weights=True, attn_mask=bias),
        [x, memory, mask],
        [layout, None, None],
        mesh,
        module=module,
        out_layouts=[layout, weights],
        what=name,
    )
    spec = layout.spec(mesh, x)
    queries = from_local_spec(spec.narrow(x), spec)
    with torch.no_grad(), count_traffic() as traffic:
        module(queries, memory, memory, need_weights=True, attn_mask=mask)
    assert_all_ranks(
        traffic.received == 0 and traffic.collective_calls == 0,
        f"{name}: the forward received {traffic.as_dict()}; expected nothing",
    )


@pytest.mark.parametrize("name", list(WEIGHTS_CASES))
def test_multihead_attention_weights_keep_the_rows(name: str) -> None:
    run_on_ranks(math.prod(WEIGHTS_CASES[name][0]), _multihead_weights_body, name)


# Tokens (L, N, E) = (5, 3, 8), two heads, with the embedding dim E split: alone (uneven; with
# an empty shard), beside the batch N or the tokens L on a 2x2 mesh. E's axes move onto N
# where N has a row for each of their ranks (2r, 2x2 beside L), else onto L (4r; 2x2 beside
# N, which another axis splits), whose keys then take the ring: mesh, layout, the rows E's
# axes split ("batch" or "tokens"), and the layout of the attention weights (N, L, S) these
# rows give (``torch.chunk``'s sizes).
EMBEDDING_CASES = {
    "2r-E-5/3": ((2,), Layout((Shard(2),), {2: (5, 3)}), "batch", Layout((Shard(0),), {0: (2, 1)})),
    "4r-E-0/3/4/1": (
        (4,),
        Layout((Shard(2),), {2: (0, 3, 4, 1)}),
        "tokens",
        Layout((Shard(1),), {1: (2, 2, 1, 0)}),
    ),
    "2x2-N-and-E": (
        (2, 2),
        Layout((Shard(1), Shard(2)), {1: (1, 2), 2: (3, 5)}),
        "tokens",
        Layout((Shard(0), Shard(1)), {0: (1, 2), 1: (3, 2)}),
    ),
    "2x2-L-and-E": (
        (2, 2),
        Layout((Shard(0), Shard(2)), {0: (4, 1), 2: (5, 3)}),
        "batch",
        Layout((Shard(1), Shard(0)), {1: (4, 1), 0: (2, 1)}),
    ),
}
EMBEDDING_VARIANTS = ["self", "weights-and-mask", "cross", "separate-projections"]


def _split_embedding_body(name: str, variant: str) -> None:
    """``nn.MultiheadAttention`` on tokens whose embedding dim is split: output values, the
    input's and every parameter's gradient as one process, the output in the input's layout;
    under the gather guard's "error" the forward gathers nothing and moves data by all-to-alls
    (and the ring's sends) only: no all-reduce of a pending projection (``count_traffic``)."""
    from shardsci import gather_policy

    mesh_shape, layout, rows, weights = EMBEDDING_CASES[name]
    mesh = get_mesh(mesh_shape)
    separate = variant == "separate-projections"
    module = nn.MultiheadAttention(8, 2, kdim=8 if separate else None, vdim=6 if separate else None)
    module = module.double()
    x = torch.randn(5, 3, 8, dtype=torch.float64)
    memory = torch.randn(5, 3, 8, dtype=torch.float64)  # as long as x: laid out like it
    if variant == "self":
        fn, inputs, layouts = (lambda m, t: m(t, t, t, need_weights=False)[0]), [x], [layout]
    elif variant == "weights-and-mask":
        mask = torch.randn(5, 5, dtype=torch.float64)
        fn = lambda m, t, bias: m(t, t, t, need_weights=True, attn_mask=bias)  # noqa: E731
        inputs, layouts = [x, mask], [layout, None]
    elif variant == "cross":
        fn = lambda m, t, kv: m(t, kv, kv, need_weights=False)[0]  # noqa: E731
        inputs, layouts = [x, memory], [layout, None]
    else:
        values = torch.randn(5, 3, 6, dtype=torch.float64)
        fn = lambda m, t, k, v: m(t, k, v, need_weights=False)[0]  # noqa: E731
        inputs, layouts = [x, memory, values], [layout, layout, None]
    out_layouts = [layout, weights] if variant == "weights-and-mask" else [layout]
    with attention_exchange("ring"):
        check_against_reference(
            fn,
            inputs,
            layouts,
            mesh,
            module=module,
            out_layouts=out_layouts,
            not_a_gather=EVERY_KEY if rows == "tokens" else "",
            what=f"{name} {variant}",
        )
        sharded = [_laid_out(t, given, mesh) for t, given in zip(inputs, layouts)]
        with torch.no_grad(), gather_policy("error"), count_traffic() as traffic:
            fn(module, *sharded)
    kinds = set(traffic.received_by_kind)
    assert_all_ranks(
        kinds <= {"all_to_all", "p2p"},
        f"{name}: the forward received {traffic.as_dict()}; expected all-to-alls and sends",
    )


def _laid_out(t: torch.Tensor, layout: Layout | None, mesh) -> torch.Tensor:
    if layout is None:
        return t
    spec = layout.spec(mesh, t)
    return from_local_spec(spec.narrow(t), spec)


# On the 2x2 blocks with need_weights=True the output's gradient reaches the backward bmm with
# its tokens split over both axes, nested, and is realigned by one all-to-all (NOTE [A product
# realigns the operand whose split disagrees]): nothing gathered.
@pytest.mark.parametrize(
    ("name", "variant"),
    [(n, v) for n in EMBEDDING_CASES for v in EMBEDDING_VARIANTS],
    ids=[f"{n}-{v}" for n in EMBEDDING_CASES for v in EMBEDDING_VARIANTS],
)
def test_multihead_attention_split_embedding_stays_split(name: str, variant: str) -> None:
    run_on_ranks(math.prod(EMBEDDING_CASES[name][0]), _split_embedding_body, name, variant)


def _errors_body() -> None:
    mesh = get_mesh((2,))
    x = torch.randn(1, 2, 9, 4, dtype=torch.float64)
    spec = Layout((Shard(2),), {2: (9, 0)}).spec(mesh, x)
    tokens = from_local_spec(spec.narrow(x), spec)
    assert_raises_all_ranks(
        NotImplementedError,
        "dropout_p=0 only",
        lambda: F.scaled_dot_product_attention(tokens, tokens, tokens, dropout_p=0.1),
    )
    wrong = torch.randn(1, 3, 9, 4, dtype=torch.float64)
    assert_raises_all_ranks(
        RuntimeError, "must match", lambda: F.scaled_dot_product_attention(tokens, wrong, wrong)
    )
    mask = torch.ones(9, 9, dtype=torch.bool)
    assert_raises_all_ranks(
        RuntimeError,
        "should not be set when is_causal=True",
        lambda: F.scaled_dot_product_attention(tokens, tokens, tokens, mask, is_causal=True),
    )


def test_bad_input_fails_on_every_rank() -> None:
    run_on_ranks(2, _errors_body)
