"""The `workflow:` block: a Python function run per task (multi-turn, tool-using RL; docs/workflows.md).

Not part of the job config yet: `trinity run` does not run workflows.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, JsonValue, field_validator

from trinity.config.megatron import StrictModel
from trinity.workflows.limits import Limits
from trinity.workflows.registry import BUILTIN_WORKFLOWS, FUNCTION_PATTERN


class WorkflowConfig(StrictModel):
    """Which workflow runs per task, its arguments and the limits of an episode."""

    function: str
    """A built-in workflow (`calculator`, `guess_number`) or a user coroutine `module.path:function`."""
    args: dict[str, JsonValue] = Field(default_factory=dict)
    """Keyword arguments the function gets after (task, session)."""
    template_args: dict[str, JsonValue] = Field(default_factory=dict)
    """Variables of the chat template itself, e.g. `{enable_thinking: false}` for Qwen3."""
    max_turns: int = Field(default=Limits.max_turns, gt=0)
    """Assistant turns per episode; one more ends it with `max_turns`."""
    context_tokens: int = Field(default=Limits.context_tokens, gt=0)
    """Tokens of a conversation; a turn whose prompt reaches it ends the episode with `context_limit`."""
    turn_timeout_s: float = Field(default=Limits.turn_timeout_s, gt=0)
    """Seconds a turn may wait for the engine, or a tool call may run."""
    episode_timeout_s: float = Field(default=Limits.episode_timeout_s, gt=0)
    """Seconds a whole episode may take."""
    on_error: Literal["fail", "zero"] = Limits.on_error
    """An episode that raises, times out or returns no valid Episode: `fail` stops the job naming the task,
    `zero` scores it 0 (end reason `error` or `timeout`)."""
    template_mismatch: Literal["segment", "fail"] = Limits.template_mismatch
    """A template that re-renders earlier turns differently (Qwen3's <think> blocks): `segment` trains each
    part as its own sequence, `fail` stops naming the tokenizer."""

    @field_validator("function")
    @classmethod
    def _function(cls, value: str) -> str:
        if value in BUILTIN_WORKFLOWS or FUNCTION_PATTERN.match(value):
            return value
        raise ValueError(f"{value!r} is neither a built-in workflow ({', '.join(sorted(BUILTIN_WORKFLOWS))}) nor "
                         "module.path:function")

    def limits(self) -> Limits:
        return Limits(max_turns=self.max_turns, context_tokens=self.context_tokens,
                      turn_timeout_s=self.turn_timeout_s, episode_timeout_s=self.episode_timeout_s,
                      on_error=self.on_error, template_mismatch=self.template_mismatch)
