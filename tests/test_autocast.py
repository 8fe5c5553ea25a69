"""Every zoo model's step under bfloat16 autocast on ShardTensors is as accurate as the same
step under autocast on one process: 2 ranks on uneven shards, float32 parameters cast by
autocast as torch casts them, the output's dtype and layout as one process's.

Both runs are measured against the float64 step without autocast: the ranks sum in another
order than one process, so their bfloat16 roundings differ element by element, and what
sharding must not do is lose accuracy. The output's and each parameter gradient's relative
error (Frobenius) may be at most three times one process's, plus 2⁻¹⁰: each rank's partial
sum (a weight's gradient over its rows, attention's aggregate over its tokens) is rounded to
bfloat16 before the ranks add them, where one process rounds the whole sum once (measured:
up to 2.4 times, the Transolver's gradients). A custom autograd Function
that saves its float32 inputs and computes its backward outside autocast fails here with a
dtype error (the linear node did, found on an H200 by ``scripts/gpu_check.sh``: NOTE [A
linear layer is one autograd node]).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from shardsci import ShardTensor, attention_exchange
from shardsci.parallel import domain_parallel
from shardsci.tensor._api import from_local_spec
from shardsci.tensor._ops._autocast import autocast_dtype, cast_for_autocast
from shardsci.testing import Layout, assert_all_ranks, get_mesh, run_on_ranks
from tests.zoo import ATTENTION_EXCHANGES, MODELS

# Rows of dim 2 per rank, and the output's where it differs (the ViT gives a patch cut by
# the split to the rank holding its first row: tests/test_zoo_sharded.py).
SIZES = {"2d": (7, 5), "3d": (5, 3)}
OUT_SIZES = {"vit": (8, 4), "vit-ring": (8, 4)}


def _error(found: torch.Tensor, truth: torch.Tensor) -> float:
    found, truth = found.detach(), truth.detach()
    return float((found.double() - truth).norm() / truth.norm().clamp_min(1e-30))


def _autocast_body(model: str) -> None:
    mesh = get_mesh((2,), ("domain",))
    rank = mesh.get_local_rank()
    three_d = model.endswith("3d")
    sizes = SIZES["3d" if three_d else "2d"]
    torch.manual_seed(0)
    plain = MODELS[model]()
    truth = copy.deepcopy(plain).double()
    sharded = domain_parallel(copy.deepcopy(plain), mesh, domain_axes=["domain"])
    x = torch.randn((1, 2, 8, 6, 6) if three_d else (2, 2, 12, 8))
    local = x.narrow(2, sum(sizes[:rank]), sizes[rank]).clone()

    outputs = {}
    for name, m, data in (
        ("truth", truth, x.double()),
        ("plain", plain, x),
        ("sharded", sharded, ShardTensor.from_local(local, mesh, [Shard(2)], "infer")),
    ):
        with (
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=name != "truth"),
            attention_exchange(ATTENTION_EXCHANGES.get(model, "ring")),
        ):
            out = m(data)
        loss = out.float().square().mean()
        (loss.full_tensor() if isinstance(loss, ShardTensor) else loss).backward()
        outputs[name] = out

    out = outputs["sharded"]
    assert out.dtype == outputs["plain"].dtype, (out.dtype, outputs["plain"].dtype)
    assert out.placements == (Shard(2),), out.placements
    assert out.to_local().shape[2] == OUT_SIZES.get(model, sizes)[rank], out.to_local().shape
    pairs = [("output", out.full_tensor(), outputs["plain"], outputs["truth"])]
    for (path, s), p, t in zip(sharded.named_parameters(), plain.parameters(), truth.parameters()):
        assert s.grad.dtype == p.grad.dtype, (path, s.grad.dtype, p.grad.dtype)
        pairs.append((f"grad of {path}", s.grad, p.grad, t.grad))
    worse = []
    for what, found, one_process, truth_value in pairs:
        allowed = 3 * _error(one_process, truth_value) + 2**-10
        if _error(found, truth_value) > allowed:
            worse.append(f"{what}: {_error(found, truth_value):.2e} > {allowed:.2e}")
    assert_all_ranks(not worse, f"{model}: less accurate than one process: {worse}")


# The linear node, the ring's autograd Functions and the spectral layers in the default run;
# the rest (the UNet's bfloat16 convolutions are slow on the CPU: 20-40 s) with -m slow.
FAST = ("vit-ring", "transolver", "fno")


def _products_body(case: str, mode: str) -> None:
    mesh = get_mesh((2,), ("domain",))
    rank = mesh.get_local_rank()
    torch.manual_seed(0)
    a, b = torch.randn(2, 10, 6), torch.randn(2, 6, 10)
    q, k, v = (torch.randn(1, 2, 10, 4) for _ in range(3))
    cases = {  # each: the whole inputs, the dim each is split along (7 / rest), the op
        "ring product": ([a, b], [1, 2], torch.matmul),
        "attention": ([q, k, v], [2, 2, 2], F.scaled_dot_product_attention),
    }
    inputs, dims, op = cases[case]
    sharded = [
        ShardTensor.from_local(
            t.narrow(d, 0, 7) if rank == 0 else t.narrow(d, 7, t.shape[d] - 7),
            mesh,
            [Shard(d)],
            "infer",
        ).requires_grad_()
        for t, d in zip(inputs, dims)
    ]
    truth = [t.double().requires_grad_() for t in inputs]
    plain = [t.clone().requires_grad_() for t in inputs]
    results = {}
    for run, operands in (("truth", truth), ("plain", plain), ("sharded", sharded)):
        with (
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=run != "truth"),
            attention_exchange(mode),
        ):
            out = op(*operands)
        loss = out.float().square().sum()
        (loss.full_tensor() if isinstance(loss, ShardTensor) else loss).backward()
        results[run] = out
    out = results["sharded"]
    assert out.dtype == results["plain"].dtype, (case, out.dtype)
    pairs = [("output", out.full_tensor(), results["plain"], results["truth"])]
    for i, (s, p, t) in enumerate(zip(sharded, plain, truth)):
        assert s.grad.dtype == p.grad.dtype, (case, i, s.grad.dtype)
        pairs.append((f"grad {i}", s.grad.full_tensor(), p.grad, t.grad))
    worse = [
        f"{case} {what}: {_error(found, t):.2e} (one process {_error(p, t):.2e})"
        for what, found, p, t in pairs
        if _error(found, t) > 3 * _error(p, t) + 2**-10
    ]
    assert_all_ranks(not worse, f"less accurate than one process: {worse}")


@pytest.mark.parametrize("mode", ["ring", "all_gather"])
@pytest.mark.parametrize("case", ["ring product", "attention"])
def test_products_of_float32_operands_under_autocast(case: str, mode: str) -> None:
    """A ring product and attention over a split dim, of float32 operands (NOTE [A product
    Function computes in autocast's dtype]): the output's and gradients' dtypes as torch's,
    as accurate as one process (the ring product's backward raised before; the ring's
    attention blocks, rounding in bfloat16, made the query gradient's error 3.3x one
    process's: NOTE [Ring attention in a lower precision])."""
    run_on_ranks(2, _products_body, case, mode)


# (B, H, L, E) queries and keys, values of width 5, the sequence dim L split: 2 ranks
# uneven, and over both axes of a 2x2 mesh with an empty shard (a ring of 4).
RING_CASES = {
    "2r-7/4": ((2,), Layout((Shard(2),), {2: (7, 4)})),
    "2x2-nested-L": ((2, 2), Layout((Shard(2), Shard(2)), {2: (2, 4, 0, 5)})),
}


def _ring_attention_body(name: str, variant: str) -> dict[str, tuple[float, float]]:
    mesh_shape, layout = RING_CASES[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 11, 8), torch.randn(2, 3, 11, 8)
    v = torch.randn(2, 3, 11, 5)
    mask = None
    if variant == "bool-mask":
        mask = (torch.rand(11, 11) > 0.5) | torch.eye(11, dtype=torch.bool)  # no row sees nothing
    elif variant == "learned-bias":
        mask = torch.randn(1, 3, 11, 11)
    spec = layout.spec(mesh, q)
    results = {}
    for run in ("truth", "plain", "sharded"):
        inputs = [t.double() if run == "truth" else t.clone() for t in (q, k, v)]
        if run == "sharded":
            inputs = [from_local_spec(spec.narrow(t), layout.spec(mesh, t)) for t in inputs]
        inputs = [t.requires_grad_() for t in inputs]
        bias = None
        if mask is not None:
            bias = mask.double() if run == "truth" and mask.is_floating_point() else mask.clone()
            bias.requires_grad_(bias.is_floating_point())
        with (
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=run != "truth"),
            attention_exchange("ring"),
        ):
            out = F.scaled_dot_product_attention(
                *inputs, attn_mask=bias, is_causal=variant == "causal"
            )
        loss = out.float().square().sum()
        (loss.full_tensor() if isinstance(loss, ShardTensor) else loss).backward()
        results[run] = (out, inputs, bias)
    out, inputs, bias = results["sharded"]
    plain_out = results["plain"][0]
    assert out.dtype == plain_out.dtype, out.dtype
    expected = layout.spec(mesh, plain_out)
    assert out.placements == expected.placements, out.placements
    assert out.to_local().shape == expected.narrow(plain_out).shape, out.to_local().shape
    pairs = [("output", out.full_tensor(), plain_out, results["truth"][0])]
    for i, operand in enumerate("qkv"):
        grads = [r[1][i].grad for r in (results["sharded"], results["plain"], results["truth"])]
        assert grads[0].dtype == grads[1].dtype, (operand, grads[0].dtype)
        pairs.append((f"grad of {operand}", grads[0].full_tensor(), *grads[1:]))
    if bias is not None and bias.requires_grad:
        runs = ("sharded", "plain", "truth")
        pairs.append(("grad of the mask", *(results[r][2].grad for r in runs)))
    errors = {what: (_error(found, t), _error(p, t)) for what, found, p, t in pairs}
    worse = [
        f"{what}: {ours:.2e} (one process {theirs:.2e})"
        for what, (ours, theirs) in errors.items()
        if ours > 3 * theirs + 2**-10
    ]
    assert_all_ranks(not worse, f"{name} {variant}: less accurate than one process: {worse}")
    return errors


@pytest.mark.parametrize("variant", ["plain", "causal", "bool-mask", "learned-bias"])
@pytest.mark.parametrize("name", list(RING_CASES))
def test_ring_attention_under_autocast_is_as_accurate_as_one_process(
    name: str, variant: str
) -> None:
    """Ring attention under bfloat16 autocast, its blocks by the CPU's fused kernel (plain)
    or by matmuls (a mask, causal): scores, softmax and every sum across blocks in float32,
    as torch's fused kernel keeps them (NOTE [Ring attention in a lower precision]); output
    and every gradient within 3x one process's error against float64, plus 2⁻¹⁰ (measured:
    at most 1.37x; rounding in bfloat16 made it up to 5.4x); the output's dtype and layout
    as one process's."""
    run_on_ranks(math.prod(RING_CASES[name][0]), _ring_attention_body, name, variant)


def test_cast_for_autocast_takes_dtype_and_device_from_one_tensor() -> None:
    """The first tensor that is not None gives both (the device was read from the first
    argument, None here: an AttributeError)."""
    x, mask = torch.randn(2, 3), torch.randn(2, 3, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_dtype(x) == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16), cast_for_autocast(None, x, mask) as cast:
        assert not torch.is_autocast_enabled("cpu")
        assert cast[0] is None and cast[2] is mask
        assert cast[1].dtype == torch.bfloat16, cast[1].dtype
    assert autocast_dtype(x) is None
    with cast_for_autocast(None, x) as same:
        assert same[1] is x


def _saved_bytes(module: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves for the backward of ``module(x)`` under
    bfloat16 autocast (a ShardTensor's: its local tensor's)."""
    storages = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        local = t.to_local() if isinstance(t, ShardTensor) else t
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
        return t

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        module(x)
    return sum(storages.values())


def _linear_saved_body() -> None:
    mesh = get_mesh((1,), ("domain",))
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 16)
    x = torch.randn(4, 32, 16, requires_grad=True)
    sharded = ShardTensor.from_local(x.detach(), mesh, [Shard(1)], "infer").requires_grad_()
    plain, ours = _saved_bytes(linear, x), _saved_bytes(linear, sharded)
    assert ours <= plain, f"a linear layer under autocast saves {ours} B, plain torch {plain} B"


def _model_saved_body(model: str) -> None:
    mesh = get_mesh((1,), ("domain",))
    torch.manual_seed(0)
    plain = MODELS[model]()
    sharded = domain_parallel(copy.deepcopy(plain), mesh, domain_axes=["domain"])
    x = torch.randn(2, 2, 32, 32)
    ours = _saved_bytes(sharded, ShardTensor.from_local(x, mesh, [Shard(2)], "infer"))
    theirs = _saved_bytes(plain, x)
    assert ours <= 1.05 * theirs, f"{model} under autocast saves {ours} B, plain torch {theirs} B"


@pytest.mark.parametrize("model", ["vit", "transolver"])
def test_a_model_under_autocast_saves_what_torch_saves(model: str) -> None:
    """Linear layers as torch's nodes and norms saving what they return (NOTE [A norm saves
    what it returns]): measured 0.96x (ViT) and 1.02x (Transolver) of plain torch's bytes;
    1.46x and 1.36x before either."""
    run_on_ranks(1, _model_saved_body, model)


def test_a_linear_layer_under_autocast_saves_what_torch_saves() -> None:
    """NOTE [A linear layer is one autograd node]: under autocast the composition runs, whose
    torch nodes save the bfloat16 copies (the node saved float32 ones: 1.36-1.46x the saved
    bytes of a one-rank ViT or Transolver step)."""
    run_on_ranks(1, _linear_saved_body)


@pytest.mark.parametrize(
    "model", [m if m in FAST else pytest.param(m, marks=pytest.mark.slow) for m in MODELS]
)
def test_a_zoo_step_under_autocast_is_as_accurate_as_one_process(model: str) -> None:
    run_on_ranks(2, _autocast_body, model)
