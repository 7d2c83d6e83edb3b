"""The `critic:` block: PPO's value model."""

from __future__ import annotations

from pydantic import Field

from trinity.config.megatron import MegatronConfig, StrictModel
from trinity.config.schema.optim import OptimConfig


class CriticConfig(StrictModel):
    """The PPO value model (same backbone as the actor, scalar head)."""

    strategy: str | None = None
    """Training backend, kept so that Trinity-RFT / verl configs paste in unchanged: only `megatron` is
    accepted (this toolkit trains with megatron-core only); unset means megatron."""
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    """Parallelism and memory options of the critic."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """Optimizer of the critic."""
    cliprange_value: float = Field(default=0.5, ge=0)
    """Value clipping range around the old values."""
    ppo_epochs: int = Field(default=1, ge=1)
    """Passes over each rollout batch."""
    warmup_steps: int = Field(default=0, ge=0)
    """Steps during which only the critic trains."""
    use_dynamic_bsz: bool = True
    """Pack the critic's sequences (values pass and update) into rows of ppo_max_token_len_per_gpu tokens
    (as actor.use_dynamic_bsz); false: padded rows of trainer.micro_batch_size sequences."""
    ppo_max_token_len_per_gpu: int | None = Field(default=None, ge=1)
    """Tokens per packed micro batch of the critic; unset: as actor.ppo_max_token_len_per_gpu's default.
    Must hold the longest sequence (data.max_prompt_length + rollout.response_length)."""
