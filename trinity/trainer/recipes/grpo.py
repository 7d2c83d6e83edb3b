"""GRPO: group-relative advantages over the `rollout.n` responses of each prompt; no critic."""

from __future__ import annotations

from typing import Any

import torch

from trinity.trainer.recipes.rl import RLRecipe


class GRPORecipe(RLRecipe):
    def advantages(self, token_rewards: torch.Tensor, groups: list[int], mask: torch.Tensor,
                   values: Any) -> tuple[torch.Tensor, torch.Tensor]:
        from trinity.algorithms.advantages import grpo_outcome_advantages

        return grpo_outcome_advantages(token_rewards.sum(-1), groups, mask, self.cfg.algorithm.norm_adv_by_std_in_grpo)
