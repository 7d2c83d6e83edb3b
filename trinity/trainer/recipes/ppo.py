"""PPO: a critic (value head on the actor's backbone) trained beside the actor; GAE advantages,
whitened over the whole batch of the DP group."""

from __future__ import annotations

from typing import Any

import torch

from trinity.config.roles import Role
from trinity.trainer.recipes.rl import RLRecipe, _dp_info, _from_last_stage
from trinity.trainer.recipes.rl_update import Experience, critic_update


class PPORecipe(RLRecipe):
    def roles(self) -> list[Role]:
        return super().roles() + [Role.critic]

    def advantages(self, token_rewards: torch.Tensor, groups: list[int], mask: torch.Tensor,
                   values: Any) -> tuple[torch.Tensor, torch.Tensor]:
        from trinity.algorithms.advantages import gae_advantages

        algo = self.cfg.algorithm
        _, dp, dp_group = _dp_info()
        return gae_advantages(token_rewards, values, mask, algo.gamma, algo.lam, group=dp_group if dp > 1 else None)

    def critic_warmup(self, step: int) -> bool:
        return step <= self.cfg.critic.warmup_steps

    def update_critic(self, exp: Experience) -> dict[str, Any]:
        cfg, critic = self.cfg, self.critic
        critic.advance_schedule()
        full = {"params": True, "grads": True, "optim": True}
        batching = self.batching["critic"].reset()
        return self.phases.run("update_critic", {"critic": full}, lambda: _from_last_stage(critic_update(
            critic, exp, cfg.critic, cfg.actor_rollout_ref.actor.loss_agg_mode,
            seqs_per_update=self.seqs_per_update, micro=batching)), batching.counts)
