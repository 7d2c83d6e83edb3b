"""PPO: a critic (value head on the actor's backbone) trained beside the actor; its GAE advantages
(whitened over the whole batch of the DP group) are the spec's estimator (trinity.algorithms.registry)."""

from __future__ import annotations

from trinity.trainer.engine import RoleEngine
from trinity.trainer.recipes import Metrics
from trinity.trainer.recipes.rl import RLRecipe, _from_last_stage
from trinity.trainer.recipes.rl_update import Experience, critic_update


class PPORecipe(RLRecipe):
    def critic_warmup(self, step: int) -> bool:
        return step <= self.cfg.critic.warmup_steps

    def update_critic(self, exp: Experience) -> Metrics:
        cfg, critic = self.cfg, self.critic
        assert isinstance(critic, RoleEngine), "PPO's roles include the critic"
        critic.advance_schedule()
        # no optimizer states: the engine brings them back for each optimizer step itself, once the
        # activations are freed (RoleOffloader.optimizer_step)
        full = {"params": True, "grads": True}
        batching = self.batching["critic"].reset()
        return self.phases.run("update_critic", {"critic": full}, lambda: _from_last_stage(critic_update(
            critic, exp, cfg.critic, cfg.actor_rollout_ref.actor.loss_agg_mode,
            seqs_per_update=self.seqs_per_update, micro=batching)), batching.counts)
