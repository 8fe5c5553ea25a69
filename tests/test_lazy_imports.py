"""``import shardsci`` is lazy (NOTE [import shardsci is lazy]): it imports neither DTensor nor
shardsci.tensor, and every public name is still there, by attribute, by ``from`` and in
``dir()``."""

from __future__ import annotations

import json
import subprocess
import sys

import shardsci

_PROBE = """
import json, sys
import shardsci
print(json.dumps({"dir": sorted(dir(shardsci)), "loaded": sorted(sys.modules)}))
"""


def test_import_shardsci_is_lazy() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], check=True, capture_output=True, text=True
    ).stdout
    probe = json.loads(out)
    heavy = {"torch.distributed.tensor", "torch._dynamo", "shardsci.tensor"}
    assert heavy.isdisjoint(probe["loaded"]), heavy & set(probe["loaded"])
    assert {*shardsci.__all__, "einsum", "tensordot", "transpose", "tensor"} <= set(probe["dir"])


def test_public_names_resolve() -> None:
    from torch.distributed.tensor import Shard

    import shardsci.tensor

    for name in shardsci.__all__:
        assert getattr(shardsci, name) is getattr(
            shardsci.tensor
            if name not in {"Partial", "Replicate", "Shard"}
            else sys.modules["torch.distributed.tensor"],
            name,
        )
    assert shardsci.Shard is Shard and shardsci.tensor is sys.modules["shardsci.tensor"]
    assert shardsci.einsum is sys.modules["shardsci._array_functions"].einsum
