"""The limits of one episode (the defaults of the `workflow:` config block come from here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

OnError = Literal["fail", "zero"]
TemplatePolicy = Literal["segment", "fail"]


@dataclass(frozen=True)
class Limits:
    max_turns: int = 8
    """Assistant turns per episode; asking for one more ends the episode with `max_turns`."""
    context_tokens: int = 4096
    """Tokens of a conversation (prompt and responses): a turn whose prompt reaches it ends the episode with
    `context_limit`; a turn generates at most the tokens left below it."""
    turn_timeout_s: float = 60.0
    """Seconds one turn may wait for the engine (its wave included) or one tool call may run."""
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
