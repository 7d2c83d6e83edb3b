"""trinity.compat.megatron_import: megatron.core imported without torch._dynamo or wandb, and the deferred
torch.compile behaving as torch.compile's own result (compiled once at the first call; inlined by an
outer compiled region)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from trinity.compat.megatron_import import lazy_compile

PROBE = """
import json, sys, time
import trinity.compat, torch
trinity.compat.install_all()  # as the workers and the CLI do
start = time.perf_counter()
import megatron.core, megatron.core.models.gpt
seconds = time.perf_counter() - start
from megatron.core.inference.contexts import dynamic_context
loaded = {m: m in sys.modules for m in ("torch._dynamo", "wandb")}
import wandb  # importable again after megatron.core
print(json.dumps({"loaded": loaded, "megatron_sees_wandb": dynamic_context.wandb is not None,
                  "wandb_after": wandb.__name__, "seconds": seconds}))
"""


def _probe(**env: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_megatron_core_imports_without_dynamo_and_wandb_and_wandb_works_after():
    light = _probe()
    assert light["loaded"] == {"torch._dynamo": False, "wandb": False}
    assert not light["megatron_sees_wandb"] and light["wandb_after"] == "wandb"
    eager = _probe(TRINITY_EAGER_MEGATRON_IMPORT="1")  # the switch: megatron-core's own import
    assert eager["loaded"] == {"torch._dynamo": True, "wandb": True} and eager["megatron_sees_wandb"]
    print(f"import megatron.core: {light['seconds']:.2f} s light, {eager['seconds']:.2f} s eager")


def test_importing_trinity_installs_nothing():
    probe = ("import sys; before = list(sys.meta_path); import trinity, trinity.compat; "
             "print(sys.meta_path == before, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["True", "False"], proc.stderr[-2000:]


def test_lazy_compile_compiles_once_at_the_first_call():
    calls = []

    def real(fn, **kwargs):
        calls.append(kwargs)
        return lambda *a: fn(*a) + 100

    compile_ = lazy_compile(real)

    @compile_(dynamic=False)  # the decorator form, with torch.compile's keyword arguments
    def double(x):
        return 2 * x

    assert calls == [] and double.__name__ == "double"
    assert double(1) == 102 and double(2) == 104
    assert calls == [{"dynamic": False}]
    compile_(torch.nn.Linear(2, 2))  # a module: torch.compile at once (its result is an OptimizedModule)
    assert calls == [{"dynamic": False}, {}]


def test_lazy_compiled_function_matches_and_is_inlined_by_an_outer_compile():
    def bias_swiglu(y, bias):
        y = y + bias
        a, b = torch.chunk(y, 2, -1)
        return torch.nn.functional.silu(a) * b

    fused = lazy_compile(torch.compile)(bias_swiglu, backend="eager")
    y, bias = torch.randn(3, 8), torch.randn(8)
    torch.testing.assert_close(fused(y, bias), bias_swiglu(y, bias), rtol=0, atol=0)

    def layer(y, bias):
        return fused(y, bias).sum(-1)

    outer = torch.compile(layer, backend="eager", fullgraph=True)  # fullgraph: a graph break would raise
    torch.testing.assert_close(outer(y, bias), bias_swiglu(y, bias).sum(-1), rtol=0, atol=0)
