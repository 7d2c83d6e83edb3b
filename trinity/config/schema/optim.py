"""The `optim:` block of a trained role (actor_rollout_ref.actor.optim, critic.optim)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trinity.config.megatron import StrictModel


class OptimConfig(StrictModel):
    """Adam optimizer and learning-rate schedule of a trained role."""

    lr: float = Field(default=1e-5, gt=0)
    """Peak learning rate."""
    min_lr: float = Field(default=0.0, ge=0)
    """Learning rate at the end of the cosine decay."""
    lr_warmup_steps: int = Field(default=0, ge=0)
    """Linear warm-up steps from 0 to lr."""
    lr_scheduler: Literal["cosine", "constant"] = "constant"
    """Schedule after warm-up."""
    weight_decay: float = Field(default=0.01, ge=0)
    """Decoupled weight decay (AdamW)."""
    adam_beta1: float = Field(default=0.9, ge=0, lt=1)
    """Adam beta1."""
    adam_beta2: float = Field(default=0.999, ge=0, lt=1)
    """Adam beta2."""
    adam_eps: float = Field(default=1e-8, gt=0)
    """Adam epsilon."""
    clip_grad: float = Field(default=1.0, ge=0)
    """Clip the global gradient norm to this value (0 disables)."""

    def warmup_within(self, total_steps: int) -> int:
        """The warm-up steps the schedule runs in a job of `total_steps`: lr_warmup_steps, cut so that the
        last step trains at the peak lr (none in a job of one step)."""
        return min(self.lr_warmup_steps, total_steps - 1) if total_steps > 1 else 0
