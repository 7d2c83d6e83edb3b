"""trinity.compat.lazy_dynamo: torch.optim without importing torch._dynamo, same updates."""

from __future__ import annotations

import json
import subprocess
import sys

_SCRIPT = r"""
import json, sys
import torch
skip = sys.argv[1] == "skip"
if skip:
    from trinity.compat.lazy_dynamo import skip_dynamo_import
    changed = skip_dynamo_import()
else:
    changed = 0
torch.manual_seed(0)
out = {}
for name, make in (("adamw_fused", lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.01, fused=True)),
                   ("adam", lambda p: torch.optim.Adam(p, lr=0.1)),
                   ("sgd", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))):
    w = torch.nn.Parameter(torch.randn(6, 5))
    opt = make([w])
    for i in range(3):
        w.grad = torch.randn(6, 5)
        opt.step()
        opt.zero_grad()
    state = opt.state_dict()
    opt.load_state_dict(state)
    out[name] = w.detach().flatten().tolist()
grad_mode = torch.is_grad_enabled()
print(json.dumps({"changed": changed, "dynamo": "torch._dynamo" in sys.modules, "grad_mode": grad_mode,
                  "weights": out}))
"""


def _run(mode: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_optimizers_step_the_same_without_importing_dynamo():
    plain, skipped = _run("plain"), _run("skip")
    # torch.optim's own wrappers import torch._dynamo at the first step; with the stand-ins nothing does
    assert plain["dynamo"] is True
    assert skipped["changed"] > 0 and skipped["dynamo"] is False, skipped
    assert skipped["grad_mode"] is True  # the step's no-grad region ends with the step
    # bit-equal updates: the stand-ins call the same update functions
    assert skipped["weights"] == plain["weights"]
