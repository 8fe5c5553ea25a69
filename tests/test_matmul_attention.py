"""Attention written by hand: ``@``, ``torch.matmul``, ``bmm``, ``mm`` and ``einsum`` with both
operands sharded over the same mesh axes, against one process in float64, forward, gradients
and output layouts (NOTE [A product of token-sharded operands is sharded by query rows]); the
bytes of the ring and of the all-gather, counted by ``count_traffic``, and the cost rule
choosing between them (NOTE [Ring or all-gather]); a ViT/UNETR-style and a Swin-style block.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Partial, Shard

from shardsci import GatherWarning, attention_exchange
from shardsci.tensor import _gather_guard
from shardsci.tensor._api import from_local_spec
from shardsci.tensor._collectives import axis_group
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
from tests.layouts import Sharded
from tests.stated_gathers import allowed_if, pending

# (B, H, L, E) queries, keys and values with their tokens L = 2 sharded; on 2x2, with the
# batch or the heads sharded too.
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
    Sharded(
        "2x2-L-and-heads",
        (2, 2),
        (2, 3, 11, 4),
        Layout((Shard(2), Shard(1)), {1: (2, 1), 2: (5, 6)}),
    ),
]
# The tokens empty on every rank: no block moves, so the ring makes no hop (``_traffic_body``).
NOBODY = [
    Sharded("2r-none", (2,), (2, 3, 0, 4), Layout((Shard(2),), {2: (0, 0)})),
    Sharded("2x2-none", (2, 2), (2, 3, 0, 4), Layout((Shard(2), Shard(2)), {2: (0,) * 4})),
]
CASE_BY_NAME = {c.name: c for c in CASES + NOBODY}

# Why a ring product may receive as many bytes as a gather of its moving operand.
EVERY_KEY = "every row meets every key: each rank receives, block by block, the keys it lacks"

# name -> (fn, the shapes of its inputs given (B, H, L, E), whether each input is sharded)
PRODUCTS = {
    "q @ k^T": (lambda q, k: q @ k.transpose(-2, -1), "qk"),
    "einsum scores": (lambda q, k: torch.einsum("bhxd,bhyd->bhxy", q, k), "qk"),
    "attn @ v": (lambda a, v: a @ v, "av"),
    "einsum values": (lambda a, v: torch.einsum("bhxy,bhye->bhxe", a, v), "av"),
    "softmax(q @ k^T * scale) @ v": (
        lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1) * 0.5, dim=-1) @ v,
        "qkv",
    ),
}


def _inputs(kinds: str, shape: tuple[int, ...]) -> list[torch.Tensor]:
    batch, heads, length, _ = shape
    shapes = {
        "q": shape,
        "k": shape,
        "v": (batch, heads, length, 5),
        "a": (batch, heads, length, length),
    }
    return [torch.randn(shapes[kind], dtype=torch.float64) for kind in kinds]


def _products_body(case_name: str, mode: str, names: list[str]) -> None:
    case = CASE_BY_NAME[case_name]
    mesh = get_mesh(case.mesh)
    for name in names:
        fn, kinds = PRODUCTS[name]
        with attention_exchange(mode):
            check_against_reference(
                fn,
                _inputs(kinds, case.shape),
                [case.layout] * len(kinds),
                mesh,
                out_layouts=[case.layout],  # the rows of q (of attn), the keys whole
                not_a_gather=EVERY_KEY,
                what=f"{case_name} {mode} {name}",
            )


@pytest.mark.parametrize("case", CASES, ids=str)
def test_scores_and_values_by_ring(case: Sharded) -> None:
    run_on_ranks(case.world, _products_body, case.name, "ring", list(PRODUCTS))


@pytest.mark.parametrize("mode", ["ring", "all_gather"])
@pytest.mark.parametrize("case", NOBODY, ids=str)
def test_tokens_no_rank_has(case: Sharded, mode: str) -> None:
    """Every product over tokens empty on every rank: equal to one process, empty outputs laid
    out as the rows, no hang (bytes and hops: ``test_bytes_of_the_ring_and_the_all_gather``).
    A ``GatherWarning`` fails it: pytest's filter reaches the ranks."""
    run_on_ranks(case.world, _products_body, case.name, mode, list(PRODUCTS))


@pytest.mark.parametrize("case", [CASES[1], CASES[3]], ids=str)
def test_scores_and_values_by_all_gather(case: Sharded) -> None:
    names = ["q @ k^T", "einsum values", "softmax(q @ k^T * scale) @ v"]
    run_on_ranks(case.world, _products_body, case.name, "all_gather", names)


# ---------------------------------------------------------------------------- other forms
def _forms_body(mode: str) -> None:
    """The same patterns as mm, bmm, broadcasting matmul and einsums with other letters; the
    contracted dim sharded in both; F.linear unaffected."""
    mesh = get_mesh((4,))
    tokens = (3, 0, 5, 3)
    on = {d: Layout((Shard(d),), {d: tokens}) for d in range(4)}
    x, gram = torch.randn(5, 11, dtype=torch.float64), Layout((Shard(0),), {0: tokens})
    q3, k3 = torch.randn(6, 11, 4, dtype=torch.float64), torch.randn(6, 11, 4, dtype=torch.float64)
    q, v = (
        torch.randn(2, 3, 11, 4, dtype=torch.float64),
        torch.randn(2, 3, 11, 5, dtype=torch.float64),
    )
    heads_k = torch.randn(3, 11, 4, dtype=torch.float64)  # keys shared by the batch
    attn = torch.randn(2, 3, 11, 11, dtype=torch.float64)
    weight = torch.randn(7, 4, dtype=torch.float64)
    checks = {
        # x sharded on its columns: the Gram matrix x^T x by torch.mm, sharded by rows.
        "x.t() @ x": (lambda a: torch.mm(a.t(), a), [x], [on[1]], gram),
        "bmm": (lambda a, b: torch.bmm(a, b.transpose(1, 2)), [q3, k3], [on[1]] * 2, on[1]),
        # (B, H, L, E) @ (H, E, L) and @ (1, H, E, L): the keys broadcast over the batch;
        # (B, H, L, L) @ (1, 1, L, E): the values over batch and heads.
        "broadcast": (lambda a, b: a @ b.transpose(-2, -1), [q, heads_k], [on[2], on[1]], on[2]),
        "broadcast size 1": (
            lambda a, b: torch.matmul(a, b.transpose(-2, -1)),
            [q, heads_k[None]],
            [on[2]] * 2,
            on[2],
        ),
        "broadcast values": (lambda a, b: a @ b, [attn, v[:1, :1]], [on[2]] * 2, on[2]),
        # Cross-attention: 9 keys in their own sizes, 11 queries; an einsum with "...".
        "cross": (
            lambda a, b: torch.einsum("...xd,...yd", a, b),
            [q, torch.randn(2, 3, 9, 4, dtype=torch.float64)],
            [on[2], Layout((Shard(2),), {2: (2, 2, 0, 5)})],
            on[2],
        ),
        # Letters in another order, the output transposed: sharded where q's rows go.
        "einsum xbhd,ybhd->bhyx": (
            lambda a, b: torch.einsum("xbhd,ybhd->bhyx", a, b),
            [q.permute(2, 0, 1, 3).contiguous(), q.permute(2, 0, 1, 3).contiguous()],
            [on[0]] * 2,
            on[3],
        ),
        # The moving operand first: its letter summed, the second operand's rows kept.
        "einsum bhyd,bhxy->bhxd": (
            lambda b, a: torch.einsum("bhyd,bhxy->bhxd", b, a),
            [v, attn],
            [on[2]] * 2,
            on[2],
        ),
        # Contracted dim sharded in both with the same boundaries: a partial sum, no traffic;
        # with other boundaries the default path moves the boundary rows first.
        "keys @ tokens": (lambda a, b: a @ b, [attn, v], [on[3], on[2]], Layout((Partial(),))),
        "keys @ other tokens": (
            lambda a, b: a @ b,
            [attn, v],
            [Layout((Shard(3),), {3: (2, 2, 4, 3)}), on[2]],
            Layout((Partial(),)),
        ),
        "F.linear": (lambda a, w: F.linear(a, w), [q, weight], [on[2], None], on[2]),
        # Only one operand needs a gradient: the backward ring carries no accumulators, or
        # computes none for the staying operand.
        "detached keys": (
            lambda a, b: a @ b.detach().transpose(-2, -1),
            [q, q],
            [on[2]] * 2,
            on[2],
        ),
        "detached rows": (lambda a, b: a.detach() @ b, [attn, v], [on[2]] * 2, on[2]),
    }
    for name, (fn, inputs, layouts, out) in checks.items():
        with attention_exchange(mode), allowed_if(pending(out)):  # a partial sum held whole
            check_against_reference(
                fn, inputs, layouts, mesh, out_layouts=[out], not_a_gather=EVERY_KEY, what=name
            )


@pytest.mark.parametrize("mode", ["ring", "all_gather"])
def test_mm_bmm_broadcasting_einsum_and_partial(mode: str) -> None:
    run_on_ranks(4, _forms_body, mode)


# ---------------------------------------------------------------------------- bytes
TRAFFIC_CASES = {
    "2r": ((7, 4), (2,)),
    "4r-empty": ((3, 0, 5, 3), (4,)),
    "2x2": ((2, 4, 0, 5), (2, 2)),
    "2r-none": ((0, 0), (2,)),
    "2x2-none": ((0, 0, 0, 0), (2, 2)),
}


def _hop_calls(mesh, axes: int) -> int:
    """Collectives the ring issues for ``N - 1`` hops over the first ``axes`` mesh axes: one
    all-to-all each where the rule sends its messages so (gloo: NOTE [An exchange of messages
    as one all-to-all where messages are slow]), else none (messages)."""
    group = axis_group(mesh, tuple(range(axes)))
    return group.size - 1 if group.messages_in_one_collective else 0


def _sharded(x: torch.Tensor, layout: Layout, mesh) -> torch.Tensor:
    spec = layout.spec(mesh, x)
    return from_local_spec(spec.narrow(x).clone().requires_grad_(True), spec)


def _traffic_body(name: str, mode: str) -> None:
    """``q @ k^T``: bytes received per rank, forward and backward (NOTE [Ring or all-gather]),
    and the largest single receive: in the ring, one block of k, never all it lacks."""
    sizes, mesh_shape = TRAFFIC_CASES[name]
    mesh = get_mesh(mesh_shape)
    batch, heads, width = 2, 3, 4
    length = sum(sizes)
    layout = Layout((Shard(2),) * len(mesh_shape), {2: sizes})
    q, k = (
        _sharded(torch.randn(batch, heads, length, width, dtype=torch.float64), layout, mesh)
        for _ in range(2)
    )
    me, n = torch.distributed.get_rank(), len(sizes)
    row = batch * heads * width * 8  # bytes of one token of k
    with attention_exchange(mode), count_traffic() as forward:
        scores = q @ k.transpose(-2, -1)
    with count_traffic() as backward:
        (scores * scores).sum().to_local().sum().backward()
    lacking = (length - sizes[me]) * row
    if mode == "ring":
        largest = max((sizes[j] for j in range(n) if j != me), default=0) * row
        hops = _hop_calls(mesh, len(mesh_shape)) if length else 0  # no block: no hop
        expected = {
            "forward": (lacking, largest, hops),
            "backward": (lacking + (length - sizes[(me - 1) % n]) * row, None, 2 * hops),
        }
    else:
        calls = 1 if length else 0  # an exchange of nothing makes no collective
        expected = {
            "forward": (lacking, lacking, calls),
            "backward": ((n - 1) * sizes[me] * row, None, calls),
        }
    got = {
        step: (t.received, t.largest_received if step == "forward" else None, t.collective_calls)
        for step, t in {"forward": forward, "backward": backward}.items()
    }
    assert_all_ranks(
        got == expected,
        f"{name} {mode}: received, largest receive, collectives {got}; expected {expected}",
    )


@pytest.mark.parametrize("mode", ["ring", "all_gather"])
@pytest.mark.parametrize("name", list(TRAFFIC_CASES))
def test_bytes_of_the_ring_and_the_all_gather(name: str, mode: str) -> None:
    run_on_ranks(len(TRAFFIC_CASES[name][0]), _traffic_body, name, mode)


def _cost_rule_body() -> None:
    """The same rule as attention's: the all-gather while k gathered (the bytes this rank
    would hold) is within the limit, said as a ``GatherWarning``; the ring one byte above it,
    which says nothing (pytest's filter makes a warning an error in the ranks)."""
    mesh = get_mesh((2,))
    layout = Layout((Shard(2),), {2: (5, 4)})
    q, k = (_sharded(torch.randn(1, 2, 9, 4, dtype=torch.float64), layout, mesh) for _ in range(2))
    gathered = 1 * 2 * 9 * 4 * 8
    said = {
        gathered: pytest.warns(GatherWarning, match="the moving operand of a product"),
        gathered - 1: nullcontext(),
    }
    chosen = {}
    _gather_guard.forget_warnings()
    for limit in (gathered, gathered - 1):
        exchange = attention_exchange("auto", gather_limit_bytes=limit)
        with exchange, counted_comm() as stats, said[limit]:
            q @ k.transpose(-2, -1)
        chosen[limit] = set(stats.calls)
    expected = {gathered: {"all_gather"}, gathered - 1: {"p2p"}}
    assert_all_ranks(chosen == expected, f"exchanges chosen by limit: {chosen}")


def test_cost_rule() -> None:
    run_on_ranks(2, _cost_rule_body)


def _bad_input_body() -> None:
    mesh = get_mesh((2,))
    layout = Layout((Shard(2),), {2: (9, 0)})
    q = _sharded(torch.randn(1, 2, 9, 4, dtype=torch.float64), layout, mesh)
    k = _sharded(torch.randn(1, 2, 9, 5, dtype=torch.float64), layout, mesh)
    assert_raises_all_ranks(
        RuntimeError, "subscript d has size 5", lambda: torch.einsum("bhxd,bhyd->bhxy", q, k)
    )


def test_bad_input_fails_on_every_rank() -> None:
    run_on_ranks(2, _bad_input_body)


# ---------------------------------------------------------------------------- blocks
class ViTBlock(nn.Module):
    """A UNETR/ViT-style transformer block, its attention written by hand: ``(B, N, C)``."""

    def __init__(self, width: int = 8, heads: int = 2, hidden: int = 12) -> None:
        super().__init__()
        self.heads, self.scale = heads, (width // heads) ** -0.5
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, c // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1) * self.scale).softmax(dim=-1)
        x = x + self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))
        return x + self.mlp(self.norm2(x))


class WindowAttention(nn.Module):
    """Swin-style window attention (as MONAI's): ``(B nW, N, C)`` tokens of windows of
    ``N = h w``, a learned relative position bias and the shifted windows' mask."""

    def __init__(self, width: int = 8, heads: int = 2, window: tuple[int, int] = (3, 4)) -> None:
        super().__init__()
        h, w = window
        self.heads, self.scale = heads, (width // heads) ** -0.5
        self.relative_position_bias_table = nn.Parameter(
            0.1 * torch.randn((2 * h - 1) * (2 * w - 1), heads)
        )
        coords = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"))
        relative = (coords.flatten(1)[:, :, None] - coords.flatten(1)[:, None, :]).permute(1, 2, 0)
        index = (relative[..., 0] + h - 1) * (2 * w - 1) + relative[..., 1] + w - 1
        self.register_buffer("relative_position_index", index)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0] * self.scale, qkv[1], qkv[2]
        attn = q @ k.transpose(-2, -1)
        index = self.relative_position_index[:n, :n].reshape(-1)
        bias = self.relative_position_bias_table[index].reshape(n, n, -1).permute(2, 0, 1)
        attn = attn + bias.unsqueeze(0)
        windows = mask.shape[0]
        attn = attn.view(b // windows, windows, self.heads, n, n) + mask.unsqueeze(1).unsqueeze(0)
        attn = attn.view(-1, self.heads, n, n).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))


# name -> (mesh, (B, N, C) layout with the tokens N sharded)
BLOCK_LAYOUTS = {
    "2r-7/5": ((2,), Layout((Shard(1),), {1: (7, 5)})),
    "4r-3/0/5/4": ((4,), Layout((Shard(1),), {1: (3, 0, 5, 4)})),
    "2x2-batch-and-N": ((2, 2), Layout((Shard(0), Shard(1)), {0: (1, 1), 1: (5, 7)})),
}


def _blocks_body(name: str, mode: str) -> None:
    mesh_shape, layout = BLOCK_LAYOUTS[name]
    mesh = get_mesh(mesh_shape)
    x = torch.randn(2, 12, 8, dtype=torch.float64)  # 2 windows (or images) of 12 tokens
    mask = torch.zeros(2, 12, 12, dtype=torch.float64)
    mask[1, :6, 6:] = mask[1, 6:, :6] = -100.0  # the shifted window's two regions
    with attention_exchange(mode):
        check_against_reference(
            lambda m, a: m(a), [x], [layout], mesh, module=ViTBlock().double(),
            not_a_gather=EVERY_KEY, what=f"ViT block {name} {mode}",
        )  # fmt: skip
        check_against_reference(
            lambda m, a, w: m(a, w), [x, mask], [layout, None], mesh,
            module=WindowAttention().double(), not_a_gather=EVERY_KEY,
            what=f"Swin window attention {name} {mode}",
        )  # fmt: skip


@pytest.mark.parametrize("name", list(BLOCK_LAYOUTS))
def test_attention_blocks_written_by_hand(name: str) -> None:
    run_on_ranks(math.prod(BLOCK_LAYOUTS[name][0]), _blocks_body, name, "ring")


def test_attention_blocks_written_by_hand_all_gather() -> None:
    run_on_ranks(4, _blocks_body, "4r-3/0/5/4", "all_gather")


def _block_traffic_body(mode: str) -> None:
    """A ViT block's forward moves only k and v: in the ring one block at a time (no single
    receive holds all of k or v), in the all-gather mode k and v whole, once each."""
    mesh = get_mesh((4,))
    sizes = (3, 0, 5, 4)
    x = _sharded(torch.randn(2, 12, 8, dtype=torch.float64), Layout((Shard(1),), {1: sizes}), mesh)
    block = ViTBlock().double()
    me = torch.distributed.get_rank()
    row = 2 * 8 * 8  # one token of k (or v): batch 2, width 8, float64
    with attention_exchange(mode), count_traffic() as traffic:
        out = block(x)
    lacking = (12 - sizes[me]) * row
    largest = max(s for j, s in enumerate(sizes) if j != me) * row
    ring = 2 * _hop_calls(mesh, 1)  # k, then v
    expected = (2 * lacking, largest if mode == "ring" else lacking, ring if mode == "ring" else 2)
    got = (traffic.received, traffic.largest_received, traffic.collective_calls)
    assert_all_ranks(
        got == expected and out._spec.placements == (Shard(1),),
        f"{mode}: received, largest receive, collectives {got}, expected {expected}; "
        f"output {out._spec}",
    )


@pytest.mark.parametrize("mode", ["ring", "all_gather"])
def test_block_moves_only_keys_and_values(mode: str) -> None:
    run_on_ranks(4, _block_traffic_body, mode)
