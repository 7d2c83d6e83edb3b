"""REINFORCE++: token returns (outcome score minus the per-token KL penalty, `algorithm.use_kl_in_reward`,
on by default here) whitened over the whole batch of the DP group: a global baseline; no critic."""

from __future__ import annotations

from typing import Any

import torch

from trinity.trainer.recipes.rl import RLRecipe, _dp_info


class ReinforcePlusPlusRecipe(RLRecipe):
    def advantages(self, token_rewards: torch.Tensor, groups: list[int], mask: torch.Tensor,
                   values: Any) -> tuple[torch.Tensor, torch.Tensor]:
        from trinity.algorithms.advantages import reinforce_plus_plus_advantages

        _, dp, dp_group = _dp_info()
        return reinforce_plus_plus_advantages(token_rewards, mask, self.cfg.algorithm.gamma, group=dp_group if dp > 1 else None)
