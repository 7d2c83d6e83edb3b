"""What a workflow's session sends to an engine and gets back, what it records per turn, and what a workflow
returns (`Episode`), with the training sequences built from its conversation.

Token ids go in and come out: an engine never sees text, so the ids a sequence is trained on are the ids the
model saw and sampled (a response is never re-tokenized from its text).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping, Protocol, Sequence, Union

import torch

from trinity.rollout.types import SamplingParams

# JSON values: tool arguments, task rows and workflow args are plain data
JSON = Union[None, bool, int, float, str, list["JSON"], dict[str, "JSON"]]
Message = dict[str, str]  # {"role": ..., "content": ...}: what the chat template renders
Task = Mapping[str, JSON]  # one data row

EndReason = Literal["finished", "max_turns", "context_limit", "timeout", "error"]
Finish = Literal["stop", "length"]  # a turn ended at a stop id, or at its token limit


class ChatTokenizer(Protocol):
    """What a session needs of a (transformers) tokenizer."""

    chat_template: str | None
    eos_token_id: int | None

    def apply_chat_template(self, conversation: list[Message], **kwargs: object) -> str: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def get_vocab(self) -> dict[str, int]: ...


@dataclass(frozen=True)
class TokenRequest:
    """One turn's generation: the prompt's token ids and how to sample (its stop ids in `eos_token_ids`);
    `episode` and `turn` (the episode's number in its run and the turn's index in it) name the turn's random
    draws, whatever else runs beside it."""

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    episode: int = 0
    turn: int = 0


@dataclass(frozen=True)
class TokenResult:
    """The sampled ids (the stop id included when the turn stopped) and log p of each under the model's
    temperature-1 distribution, as `trinity.rollout.types.Rollout.logprobs` defines them."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish: Finish


class ChatBackend(Protocol):
    """An engine behind `Session.chat`: one result per request, in order. Called from a worker thread,
    one call at a time."""

    def generate(self, requests: Sequence[TokenRequest]) -> list[TokenResult]: ...


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, JSON]


@dataclass(frozen=True)
class Turn:
    """One assistant turn as the engine ran it."""

    prompt_ids: tuple[int, ...]  # everything the model saw (the segment so far, then the new turn's prompt)
    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish: Finish
    text: str  # the decoded response without its stop id: the assistant message's content
    tool_calls: tuple[ToolCall, ...] = ()
    tool_errors: tuple[str, ...] = ()  # malformed tool calls, as the message the model is sent back


@dataclass(frozen=True)
class TrainingSequence:
    """One conversation (or one segment of it, see `trinity.workflows.transcript`) as a training row.

    Position-aligned: `loss_mask[i]` is 1 where tokens[i] was sampled by the model (assistant tokens), 0 on
    everything the template, the user, tools or the environment put there; `logprobs[i]` is the behaviour
    log p(tokens[i] | tokens[:i]) the engine sampled it with (0.0 where the mask is 0). A trainer's
    next-token log-prob of position i-1 is the one to compare with logprobs[i]."""

    tokens: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...]

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens long [S], loss_mask long [S], logprobs float32 [S])."""
        return (torch.tensor(self.tokens, dtype=torch.long), torch.tensor(self.loss_mask, dtype=torch.long),
                torch.tensor(self.logprobs, dtype=torch.float32))


@dataclass(frozen=True)
class Episode:
    """What a workflow returns for one task: the conversation, its training sequences, the reward (or
    per-turn rewards) and why it ended."""

    task: Task
    messages: tuple[Message, ...]
    turns: tuple[Turn, ...]
    sequences: tuple[TrainingSequence, ...]
    end: EndReason
    reward: float | None = None
    turn_rewards: tuple[float, ...] | None = None
    error: str | None = None  # what went wrong (end "error" or "timeout")
