"""benchmarks/rl_step.py --lengths: the EOS schedule inside a real `trinity run` (benchmarks/eos_schedule.py).

Python imports `sitecustomize` at the start of every process whose path holds this folder: the benchmark
puts it on the job's PYTHONPATH, so that the launcher, torchrun and every rank run this. With
TRINITY_BENCH_RESPONSE_LENGTHS set (not `fixed`), `trinity.rollout.continuous` is patched right after
its first import; nothing else changes.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

_TARGET = "trinity.rollout.continuous"


def _schedule_module():
    path = Path(__file__).resolve().parents[1] / "eos_schedule.py"
    spec = importlib.util.spec_from_file_location("bench_eos_schedule", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, kind: str) -> None:
        self.kind = kind

    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)  # once
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module
        kind = self.kind

        def exec_module(module):
            run(module)
            _schedule_module().patch(module, kind)

        spec.loader.exec_module = exec_module
        return spec


_kind = os.environ.get("TRINITY_BENCH_RESPONSE_LENGTHS", "fixed")
if _kind != "fixed" and _TARGET not in sys.modules:
    sys.meta_path.insert(0, _PatchOnImport(_kind))
