"""RLOO: each response's baseline is the mean reward of the other rollout.n - 1 responses to its prompt; no critic."""

from __future__ import annotations

from typing import Any

import torch

from trinity.trainer.recipes.rl import RLRecipe


class RLOORecipe(RLRecipe):
    def advantages(self, token_rewards: torch.Tensor, groups: list[int], mask: torch.Tensor,
                   values: Any) -> tuple[torch.Tensor, torch.Tensor]:
        from trinity.algorithms.advantages import rloo_outcome_advantages

        return rloo_outcome_advantages(token_rewards.sum(-1), groups, mask)
