"""NOTE [Dynamo is configured when it loads]: a rank that compiles nothing never imports
dynamo, and dynamo imported later is told what shardsci would have told it at import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]

_PROBE = """
import sys
import shardsci.train  # everything a rank of the training command imports
assert "torch._dynamo" not in sys.modules, "importing shardsci imported dynamo"
import torch
from shardsci.tensor import ShardTensor, _api, _promotion
import torch._dynamo.config, torch._dynamo.trace_rules as rules
from torch._dynamo.variables import TorchInGraphFunctionVariable
assert ShardTensor in torch._dynamo.config.nontraceable_tensor_subclasses
wrappers = (_api._from_local, _api._to_local, _promotion._traced_promotion)
assert all(rules.lookup_callable(f) is TorchInGraphFunctionVariable for f in wrappers)
print("ok")
"""


def test_dynamo_loads_on_demand_and_is_configured_when_it_does() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=_ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
