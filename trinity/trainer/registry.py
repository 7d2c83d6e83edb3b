"""Training loops by algorithm name, and what the worker hands them.

A loop is `run(ctx: WorkerContext) -> None`. Entries are `module:function` strings so that looking
one up imports only that loop. The RL loops register here:

    LOOPS["grpo"] = "trinity.trainer.grpo:run_grpo"
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from trinity.config.loader import LoadedConfig
from trinity.config.schema import JobConfig
from trinity.errors import UserError

LOOPS: dict[str, str] = {
    "sft": "trinity.trainer.sft:run_sft",
    "pt": "trinity.data.pretrain:run_pt",  # the SFT loop on pre-training data
    "grpo": "trinity.trainer.rl:run_rl",
    "ppo": "trinity.trainer.rl:run_rl",
}


@dataclass
class WorkerContext:
    """One rank's view of the job once the actor is built and its weights are loaded."""

    loaded: LoadedConfig
    device: Any  # torch.device
    dtype: Any  # torch.dtype of the parameters
    actor: list[Any]  # GPTModel chunks (one per VPP stage), not yet wrapped in DDP
    rank: int
    world_size: int

    @property
    def config(self) -> JobConfig:
        return self.loaded.config

    @property
    def facts(self) -> Any:
        return self.loaded.facts

    @property
    def output_dir(self) -> Path:
        return Path(self.config.trainer.output_dir)

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    def log(self, text: str) -> None:
        """Print on rank 0 only (torchrun shows rank 0; every rank's output is in logs/)."""
        if self.is_rank0:
            print(text, flush=True)


Loop = Callable[[WorkerContext], None]


def get_loop(name: str) -> Loop:
    target = LOOPS.get(name)
    if target is None:
        raise UserError(f"algorithm.name: no training loop is registered for {name!r}; known: {', '.join(LOOPS)}")
    module, _, func = target.partition(":")
    return getattr(importlib.import_module(module), func)
