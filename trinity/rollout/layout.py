"""The `Rollout` layout both generators return: left-padded prompts, right-padded responses."""

from __future__ import annotations

from typing import Sequence

import torch

from trinity.rollout.types import Rollout


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, P], mask [B, P]) with each prompt right-aligned."""
    width = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        if p:
            tokens[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
            mask[i, width - len(p) :] = 1
    return tokens.to(device), mask.to(device)


def assemble(tokens: torch.Tensor, prompt_mask: torch.Tensor, responses: torch.Tensor, lengths: torch.Tensor,
             logprobs: torch.Tensor) -> Rollout:
    """The `Rollout` of left-padded prompts and responses [B, width] of `lengths` tokens (later positions
    hold padding and get mask 0 and log-prob 0)."""
    width = responses.shape[1]
    response_mask = (torch.arange(width, device=responses.device).unsqueeze(0) < lengths.unsqueeze(1)).long()
    return Rollout(
        tokens=torch.cat([tokens, responses], dim=1),
        prompt_mask=prompt_mask,
        response_mask=response_mask,
        logprobs=logprobs * response_mask,
    )
