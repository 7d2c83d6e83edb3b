"""The root of the job config (`JobConfig`): one field per block, the defaults that depend on the
algorithm, and which roles the job has.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from trinity.config.megatron import MegatronConfig, StrictModel
from trinity.config.schema.actor_rollout_ref import ActorRolloutRefConfig
from trinity.config.schema.algorithm import AlgorithmConfig, AlgorithmName
from trinity.config.schema.cluster import ClusterConfig
from trinity.config.schema.critic import CriticConfig
from trinity.config.schema.data import DataConfig
from trinity.config.schema.model import ModelConfig
from trinity.config.schema.reward import RewardConfig, RewardModelConfig
from trinity.config.schema.trainer import TrainerConfig


class JobConfig(StrictModel):
    """A trinity job: what to train, on what data, where, with which parallel layout."""

    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """Algorithm and its advantage/KL settings."""
    model: ModelConfig
    """The HF model to fine-tune."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Training data."""
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    """Devices, nodes and processes."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """Steps, batches, checkpoints, logging."""
    actor_rollout_ref: ActorRolloutRefConfig = Field(default_factory=ActorRolloutRefConfig)
    """Actor, reference and rollout."""
    critic: CriticConfig | None = None
    """PPO critic; required for ppo, not allowed for sft and grpo."""
    reward: RewardConfig = Field(default_factory=RewardConfig)
    """RL reward function."""
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig)
    """dapo: overlong reward shaping (verl's reward_model.overlong_buffer)."""

    def roles(self) -> dict[str, MegatronConfig]:
        """Megatron blocks of the roles that exist in this job, keyed by their config path."""
        out = {"actor_rollout_ref.actor": self.actor_rollout_ref.actor.megatron}
        # with LoRA the reference policy is the actor with its adapters off: no ref model is built
        if self.needs_ref and self.actor_rollout_ref.actor.lora.rank == 0:
            out["actor_rollout_ref.ref"] = self.actor_rollout_ref.ref.megatron
        if self.needs_critic and self.critic is not None:
            out["critic"] = self.critic.megatron
        return out

    @model_validator(mode="before")
    @classmethod
    def _pt_concatenates(cls, data: Any) -> Any:
        """data.packing defaults to false for pt and dpo (see its docstring); an explicit value stands."""
        if not isinstance(data, dict):
            return data
        algo, section = data.get("algorithm"), data.get("data")
        name = algo.get("name") if isinstance(algo, dict) else None
        # dpo pads each sequence to its own row (a pair's log-probs are per-sequence sums): false too, and
        # an explicit true is refused (trinity.config.rules.algorithms)
        if name in (AlgorithmName.pt, "pt", AlgorithmName.dpo, "dpo") \
                and (section is None or (isinstance(section, dict) and "packing" not in section)):
            data = {**data, "data": {**(section or {}), "packing": False}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _reinforce_pp_kl_in_reward(cls, data: Any) -> Any:
        """algorithm.use_kl_in_reward defaults to true for reinforce_plus_plus: the per-token KL penalty in
        the reward is part of REINFORCE++ (the paper, and verl's example); an explicit value stands."""
        if not isinstance(data, dict):
            return data
        algo = data.get("algorithm")
        if isinstance(algo, dict) and algo.get("name") in (AlgorithmName.reinforce_plus_plus, "reinforce_plus_plus") \
                and "use_kl_in_reward" not in algo:
            data = {**data, "algorithm": {**algo, "use_kl_in_reward": True}}
        return data

    @property
    def needs_ref(self) -> bool:
        """The reference model exists for RL jobs that use KL, and for dpo (the frozen initial policy)."""
        return self.algorithm.name == AlgorithmName.dpo or self.is_rl and (
            self.actor_rollout_ref.actor.use_kl_loss or self.algorithm.use_kl_in_reward
        )

    @property
    def needs_critic(self) -> bool:
        """The critic (value model) exists for ppo only."""
        return self.algorithm.name == AlgorithmName.ppo

    @property
    def is_rl(self) -> bool:
        """Whether the job generates rollouts (dpo trains offline on pairs, like SFT: not RL here)."""
        return self.algorithm.name not in (AlgorithmName.sft, AlgorithmName.pt, AlgorithmName.dpo)
