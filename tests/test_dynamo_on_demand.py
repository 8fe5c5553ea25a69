"""NOTE [Dynamo is configured when it loads]: a rank that compiles nothing never imports
dynamo, AOTAutograd or inductor, and each imported later is told what shardsci would have
told it at import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]

_PROBE = """
import sys
import shardsci.train  # everything a rank of the training command imports
stages = ("torch._dynamo", "torch._functorch.aot_autograd", "torch._inductor.graph")
loaded = [name for name in stages if name in sys.modules]
assert not loaded, f"importing shardsci imported {loaded}"
import torch
from shardsci.tensor import ShardTensor, _api, _promotion
import torch._dynamo.config, torch._dynamo.trace_rules as rules
from torch._dynamo.variables import TorchInGraphFunctionVariable
assert ShardTensor not in torch._dynamo.config.nontraceable_tensor_subclasses
wrappers = (_api._from_local, _api._to_local, _promotion._traced_promotion)
assert all(rules.lookup_callable(f) is TorchInGraphFunctionVariable for f in wrappers)
assert any(path.endswith("shardsci/tensor/") for path in rules.BUILTIN_INLINE_WHEN_CALLED)
import torch._functorch.aot_autograd as aot
from torch._functorch._aot_autograd import graph_compile
from torch._inductor.graph import GraphLowering
from torch._inductor import decomposition
told = (
    aot.run_functionalized_fw_and_collect_metadata,
    graph_compile.run_joint_graph_passes_on_hops,
    graph_compile.aot_stage2_autograd,
    GraphLowering.decide_layout_opt,
    decomposition.decompositions[torch.ops.aten.add.Tensor],
    decomposition.fast_random_decomps()[torch.ops.aten.add.Tensor],
)
assert all(f.__code__.co_filename.endswith("_torch_compile.py") for f in told), told
print("ok")
"""


def test_dynamo_loads_on_demand_and_is_configured_when_it_does() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=_ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
