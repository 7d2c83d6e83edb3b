"""What the worker hands the training loop: one rank's view of the job, and how it builds a role."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from trinity.config.loader import LoadedConfig
from trinity.config.roles import Role
from trinity.config.schema import JobConfig

if TYPE_CHECKING:
    import torch

    from trinity.models.facts import ModelFacts
    from trinity.trainer.engine import RoleEngine
    from trinity.trainer.nonfinite import NonFiniteGuard


@dataclass
class WorkerContext:
    """One rank's view of the job once the parallel state is set up."""

    loaded: LoadedConfig
    device: torch.device
    dtype: torch.dtype  # of the parameters
    rank: int
    world_size: int

    @property
    def config(self) -> JobConfig:
        return self.loaded.config

    @property
    def facts(self) -> ModelFacts:
        return self.loaded.facts

    @property
    def output_dir(self) -> Path:
        return Path(self.config.trainer.output_dir)

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @cached_property
    def nonfinite(self) -> NonFiniteGuard:
        """The run's one NonFiniteGuard (trinity.trainer.nonfinite): every engine reports to it, the loop
        tells it the step and the last checkpoint."""
        from trinity.trainer.nonfinite import NonFiniteGuard

        return NonFiniteGuard(self.config.trainer.skip_nonfinite_steps, log=self.log)

    def log(self, text: str) -> None:
        """Print on rank 0 only (torchrun shows rank 0; every rank's output is in logs/)."""
        if self.is_rank0:
            print(text, flush=True)

    def build_engine(self, role: Role, total_steps: int, *, optimizer_on_host: bool = False) -> RoleEngine:
        """`role`'s engine: its chunks built, loaded from the job's weight source for it, and wrapped
        (DDP, optimizer and an LR schedule over `total_steps` when the role is trained)."""
        from trinity.config.weights import weight_source
        from trinity.trainer.engine import RoleEngine

        cfg = self.config
        lora = cfg.actor_rollout_ref.actor.lora if role is Role.actor else None  # the trained policy only
        engine = RoleEngine.build(
            role, self.facts, role.megatron(cfg), role.optim(cfg), weight_source(cfg, role),
            device=cfg.cluster.device, dtype=self.dtype, total_steps=total_steps, optimizer_on_host=optimizer_on_host,
            lora=lora, nonfinite=self.nonfinite,
        )
        if engine.lora_loaded:
            self.log(f"LoRA: adapters of {engine.lora_loaded} linears loaded from {lora.adapter_path}")
        return engine
