"""What a rollout engine takes and gives back, and the interface any rollout engine offers.

`SamplingParams` in, `Rollout` out; `RolloutEngine` is what the RL recipes call. The built-in engine
is `trinity.rollout.continuous.ActorRollout` (continuous batching over the actor's own megatron-core model);
another (vLLM, SGLang, a remote server) only has to return the same `Rollout`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 128
    eos_token_ids: tuple[int, ...] = ()


@dataclass
class Rollout:
    """A batch of sequences `[prompt (left-padded) | response (right-padded)]`.

    tokens [B, P + R]; prompt_mask [B, P] (1 on real prompt tokens); response_mask [B, R] (1 on generated
    tokens up to and including EOS); logprobs [B, R] fp32 (see module doc; 0 where the mask is 0).
    """

    tokens: torch.Tensor
    prompt_mask: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor

    @property
    def prompt_len(self) -> int:
        return self.prompt_mask.shape[1]

    @property
    def response_len(self) -> int:
        return self.response_mask.shape[1]

    @property
    def responses(self) -> torch.Tensor:
        return self.tokens[:, self.prompt_len :]

    def attention_pad_mask(self) -> torch.Tensor:
        """[B, P + R] 1 where a key is a real token (prompt padding is 0; response tail counts as real:
        only tokens after EOS look at it, and they are masked out of every loss)."""
        ones = torch.ones_like(self.response_mask)
        return torch.cat([self.prompt_mask, ones], dim=1)

    def select(self, index: torch.Tensor | slice) -> "Rollout":
        return Rollout(self.tokens[index], self.prompt_mask[index], self.response_mask[index], self.logprobs[index])


class RolloutEngine(Protocol):
    """Generates `max_new_tokens` (at most) after each prompt; every rank of a model-parallel group
    returns the same `Rollout`."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 generator: torch.Generator | None = None) -> Rollout: ...
