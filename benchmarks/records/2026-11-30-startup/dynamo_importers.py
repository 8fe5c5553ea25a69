"""Which of a plain run's steps import ``torch._dynamo``, each in a fresh process: ``python
dynamo_importers.py``. One JSON line per step: whether ``torch._dynamo`` was loaded after it."""

from __future__ import annotations

import json
import subprocess
import sys

STEPS = {
    "import torch": "import torch",
    "nn.Linear built on the meta device": (
        "import torch\nwith torch.device('meta'):\n    torch.nn.Linear(3, 3)"
    ),
    "torch.rand on the meta device (the FNO's spectral weights, in the checks)": (
        "import torch\nwith torch.device('meta'):\n    torch.rand(3)"
    ),
    "an optimizer built (training)": (
        "import torch\ntorch.optim.AdamW(torch.nn.Linear(3, 3).parameters())"
    ),
    "a model's state dict through torch.distributed.checkpoint (prediction, checkpoints)": (
        "import torch\nfrom torch.distributed.checkpoint.state_dict import get_model_state_dict\n"
        "get_model_state_dict(torch.nn.Linear(3, 3))"
    ),
}

for name, code in STEPS.items():
    probe = f"{code}\nimport sys\nprint('torch._dynamo' in sys.modules)"
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    )
    print(json.dumps({"step": name, "imports_torch_dynamo": loaded.stdout.strip() == "True"}))
