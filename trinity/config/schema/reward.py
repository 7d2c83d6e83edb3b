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
    timeout_s: float = Field(default=10.0, gt=0, allow_inf_nan=False)
    """Seconds the reward function may take per sample: a call on a batch of n samples is stopped after
    n × timeout_s. The function runs in a process of its own beside each rank, which is ended when a call
    runs over (a function that never returns would otherwise hang the job without a word); a stopped
    call is an error of the sample (`on_error`). The default leaves math checks ample time: math_verify
    limits its own parse and compare to 5 s each."""
    on_error: Literal["fail", "zero"] = "fail"
    """What a sample whose reward fails gets: the function raised, ran past `timeout_s`, or returned a
    non-number, NaN or an infinite value for it. `fail`: the job stops with one line naming the function
    and the sample (its index, the start of its prompt and response). `zero`: the sample scores 0, the
    step's `reward/errors` metric counts it, and one warning per step gives the first such line."""


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
