"""``torch.compile(model)`` traced through ShardTensors, the experimental opt-in
``tracing_through_shardtensors`` (NOTE [torch.compile and ShardTensor]).

Each case compiles a function of ShardTensors with AOTAutograd (``aot_eager``: forward and
backward aten graphs, no code generation) and checks, on 2 gloo ranks with uneven shards:
the backend received graphs and the collectives are functional ones inside them; output,
output layout, input gradient and every parameter gradient equal the single-process eager
model on the same global data in float64 (``_compiled_equals_eager``); the same layout runs
again with no recompilation, and a new layout compiles once more.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

from shardsci.tensor._torch_compile import tracing_through_shardtensors
from shardsci.testing import Layout, assert_all_ranks, get_mesh, run_on_ranks
from tests.test_compile import FIELD_LAYOUTS, _compiled_equals_eager
from tests.zoo import MODELS


class PointwiseChain(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.sin(x) * 2 + 1).relu() - x.exp() / 3


class ConvWithHalo(nn.Module):
    """Two 3x3 convolutions: each exchanges a halo of one row with the neighbour."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Conv2d(2, 3, 3, padding=1)
        self.second = nn.Conv2d(3, 2, 3, padding=1, padding_mode="circular")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


class Centered(nn.Module):
    """Subtracts the global mean: a reduction whose partial sums are all-reduced."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean()


class EinsumThenFlatten(nn.Module):
    """Channels mixed by an einsum whose local result has permuted strides where the global
    stride is contiguous, then two dims flattened (the Transolver's ``cells.flatten(-2)``):
    the view cannot take the shard's memory layout and copies it, on fake shards too."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(2, 3))  # (C, M)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scaled = torch.einsum("bchw,cm->bhwcm", x, self.scale)  # C outermost in memory
        return scaled.flatten(-2).movedim(-1, 1)  # (B, C M, H, W)


class UpThenDown(nn.Module):
    """Bilinear 2x upsampling, then 2x2 average pooling back to the input's shape (and shard
    sizes). Dynamo puts ``F.interpolate``, a Python-level function, into the graph whole and
    runs its handler on fake shards: a plan of real index tables (``on_the_host``), then
    ``to_local`` and ``from_local_spec``, which dynamo failed on inside the handler."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.avg_pool2d(F.interpolate(x, scale_factor=2, mode="bilinear"), 2)


CASES = {
    "pointwise": (PointwiseChain, ()),
    "conv": (ConvWithHalo, ("all_to_all_single", "all_reduce")),
    "mean": (Centered, ("all_reduce",)),
    "flatten": (EinsumThenFlatten, ("all_reduce",)),
    "interpolate": (UpThenDown, ("all_to_all_single",)),
}
"""Case -> (module, functional collectives its forward and backward graphs must contain, or
none at all)."""

WHOLE_SHAPE = (2, 2, 11, 6)
LAYOUTS = [Layout((Shard(2),), {2: (7, 4)}), Layout((Shard(2),), {2: (3, 8)})]


def _collectives_in(graphs: list[torch.fx.GraphModule]) -> set[str]:
    return {
        node.target._opname
        for graph in graphs
        for node in graph.graph.nodes
        if node.op == "call_function" and "_c10d_functional" in str(node.target)
    }


def _compiled_body(case: str) -> None:
    with tracing_through_shardtensors():
        _check_compiled(case)


def _check_compiled(case: str) -> None:
    mesh = get_mesh((2,))
    module_type, collectives = CASES[case]
    torch.manual_seed(0)
    model = module_type().double()
    recorder = torch._dynamo.testing.AotEagerAndRecordGraphs()
    counter = torch._dynamo.testing.CompileCounterWithBackend(recorder)
    compiled = torch.compile(model, backend=counter)
    whole = torch.randn(WHOLE_SHAPE, dtype=torch.float64)
    frames = []
    for layout in LAYOUTS:
        for again in (False, True):
            # A layout seen before must pass every guard: a recompilation raises, with why.
            with torch._dynamo.config.patch(error_on_recompile=again):
                _compiled_equals_eager(compiled, [whole], [layout], mesh, f"{case} {layout}")
        frames.append(counter.frame_count)
    # The first layout compiles two frames: the reference call on whole plain tensors (the
    # same compiled model), then the ShardTensors; a new layout compiles one more.
    assert_all_ranks(
        frames == [2, 3], f"{case}: frames compiled after each layout {frames} (expected [2, 3])"
    )
    assert_all_ranks(
        len(recorder.fw_graphs) == 3 and len(recorder.bw_graphs) == 3,
        f"{case}: {len(recorder.fw_graphs)} forward, {len(recorder.bw_graphs)} backward graphs",
    )
    found = _collectives_in(recorder.fw_graphs + recorder.bw_graphs)
    expected = {*collectives, "wait_tensor"} if collectives else set()
    assert_all_ranks(
        expected <= found and bool(found) == bool(expected),
        f"{case}: functional collectives {found} in the graphs (expected {expected})",
    )


# The halo case compiles 6 graphs with halo code inlined: about 65 s on this machine (load 9);
# the flatten case about 32 s (load 6), the interpolate case 44 s (load 8-12).
SLOW_CASES = ("conv", "flatten", "interpolate")


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=[pytest.mark.slow] if c in SLOW_CASES else []) for c in CASES]
)
def test_torch_compile_traces_through_shardtensors(case: str) -> None:
    run_on_ranks(2, _compiled_body, case, timeout_s=300)


def _zoo_body(name: str) -> None:
    with tracing_through_shardtensors():
        mesh = get_mesh((2,))
        torch.manual_seed(0)
        model = MODELS[name]().double()
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(model, backend=counter)
        whole = torch.randn((2, 2, 16, 12), dtype=torch.float64)
        frames = []
        for layout in FIELD_LAYOUTS[(2,)]:
            for again in (False, True):
                with torch._dynamo.config.patch(error_on_recompile=again):
                    _compiled_equals_eager(compiled, [whole], [layout], mesh, f"{name} {layout}")
            frames.append(counter.frame_count)
        assert_all_ranks(frames == [2, 3], f"{name}: frames compiled after each layout {frames}")


# The zoo models that trace through (NOTE [torch.compile and ShardTensor] lists those that do
# not and why). About 60 s for the FNO (load 9), 220 s for the ViT and 340 s for the
# Transolver (load 6-10) on this machine.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["fno", "transolver", "vit"])
def test_zoo_model_traced_through_equals_the_single_process_model(name: str) -> None:
    run_on_ranks(2, _zoo_body, name, timeout_s=600)
