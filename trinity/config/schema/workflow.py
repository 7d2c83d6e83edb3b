"""The `workflow:` block of a job (`JobConfig.workflow`): a Python function run per task (multi-turn,
tool-using RL; docs/workflows.md); trinity.config.rules.workflow holds its cross-field rules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from pydantic import Field, JsonValue, field_validator

from trinity.config.megatron import StrictModel

# what `workflow.function` may name (trinity.workflows.registry resolves it)
BUILTIN_WORKFLOWS: dict[str, str] = {
    "calculator": "trinity.workflows.calculator:calculator_workflow",
    "guess_number": "trinity.workflows.guess_number:guess_number_workflow",
}
FUNCTION_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")


OnError = Literal["fail", "zero"]
TemplatePolicy = Literal["segment", "fail"]


@dataclass(frozen=True)
class Limits:
    """The limits of one episode (trinity.workflows.runner applies them); the `workflow:` block's defaults."""

    max_turns: int = 8
    """Assistant turns per episode; asking for one more ends the episode with `max_turns`."""
    context_tokens: int = 4096
    """Tokens of a conversation (prompt and responses): a turn whose prompt reaches it ends the episode with
    `context_limit`; a turn generates at most the tokens left below it."""
    turn_timeout_s: float = 60.0
    """Seconds one turn may wait for the engine (its decoding included) or one tool call may run."""
    episode_timeout_s: float = 600.0
    """Seconds a whole episode may take."""
    on_error: OnError = "fail"
    """An episode that raises, runs past a timeout or returns something other than an Episode with a finite
    reward: `fail` stops the run with a line naming the workflow and the task; `zero` keeps the episode,
    scored 0, with end `error` or `timeout` and the message in `Episode.error`."""
    template_mismatch: TemplatePolicy = "segment"
    """A turn whose rendered prompt does not extend the conversation's tokens so far (a template that
    re-renders earlier turns, e.g. Qwen3 dropping earlier <think> blocks): `segment` starts a new training
    sequence from the re-rendered prompt, `fail` raises `TemplateMismatch` naming the tokenizer."""

    def __post_init__(self) -> None:
        for name in ("max_turns", "context_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.on_error not in ("fail", "zero"):
            raise ValueError(f"on_error must be fail or zero, got {self.on_error!r}")
        if self.template_mismatch not in ("segment", "fail"):
            raise ValueError(f"template_mismatch must be segment or fail, got {self.template_mismatch!r}")
        for name in ("turn_timeout_s", "episode_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")



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
    context_tokens: int | None = Field(default=None, gt=0)
    """Tokens of a conversation; a turn whose prompt reaches it ends the episode with `context_limit`.
    Unset: data.max_prompt_length + actor_rollout_ref.rollout.response_length, the RL sequence length that
    the token budgets, the KV cache and the model's positions are checked against (at most that)."""
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

    def limits(self, sequence_tokens: int = Limits.context_tokens) -> Limits:
        """The runner's limits; `sequence_tokens`: the context limit where `context_tokens` is unset (a job's
        RL sequence length, `JobConfig.workflow_context_tokens`)."""
        context = self.context_tokens if self.context_tokens is not None else sequence_tokens
        return Limits(max_turns=self.max_turns, context_tokens=context,
                      turn_timeout_s=self.turn_timeout_s, episode_timeout_s=self.episode_timeout_s,
                      on_error=self.on_error, template_mismatch=self.template_mismatch)
