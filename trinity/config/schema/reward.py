"""The `reward:` block (how RL responses are scored) and verl's `reward_model:` block (DAPO's overlong
shaping).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trinity.config.megatron import StrictModel


class RewardConfig(StrictModel):
    """How responses are scored in RL."""

    function: str = "math_exact_match"
    """A built-in reward (`math_exact_match`, `math_verify`, `format`) or a user function `module.path:function`."""
    extractor: Literal["last_number", "boxed", "after_marker"] = "last_number"
    """How math_exact_match and math_verify find the answer in a response (math_verify: `last_number` takes
    the last `\\boxed{...}` when there is one)."""
    marker: str = "####"
    """Marker for the after_marker extractor."""
    format_pattern: str | None = None
    """Regex for the `format` reward (full match scores 1)."""


class OverlongBufferConfig(StrictModel):
    """DAPO's soft overlong punishment (verl's `reward_model.overlong_buffer`)."""

    enable: bool = False
    """dapo: add a penalty to the score of responses longer than rollout.response_length - len tokens."""
    len: int = Field(default=0, ge=0)
    """Tokens of the buffer: the penalty grows linearly from 0 at response_length - len tokens to
    penalty_factor at response_length; must be in [1, response_length) when enabled."""
    penalty_factor: float = Field(default=1.0, ge=0)
    """Penalty of a response of rollout.response_length tokens."""


class RewardModelConfig(StrictModel):
    """verl's `reward_model` block: here only DAPO's overlong reward shaping (the reward itself is `reward`)."""

    overlong_buffer: OverlongBufferConfig = Field(default_factory=OverlongBufferConfig)
    """dapo: overlong reward shaping."""
