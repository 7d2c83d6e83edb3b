"""The root of the job config (`JobConfig`): one field per block, the defaults that depend on the
algorithm, and which roles the job has.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from trinity.algorithms.registry import ALGORITHMS, AlgorithmSpec
from trinity.config.megatron import MegatronConfig, StrictModel
from trinity.config.schema.actor_rollout_ref import ActorRolloutRefConfig
from trinity.config.schema.algorithm import AlgorithmConfig
from trinity.config.schema.cluster import ClusterConfig
from trinity.config.schema.critic import CriticConfig
from trinity.config.schema.data import DataConfig
from trinity.config.schema.model import ModelConfig
from trinity.config.schema.reward import RewardConfig, RewardModelConfig
from trinity.config.schema.trainer import TrainerConfig
from trinity.config.schema.workflow import WorkflowConfig


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
    workflow: WorkflowConfig | None = None
    """RL: a multi-turn, tool-using workflow run per task instead of one response per prompt; it scores its
    own episodes (no `reward:`). docs/workflows.md."""

    @property
    def spec(self) -> AlgorithmSpec:
        """What algorithm.name's algorithm is made of (trinity.algorithms.registry): every rule and step
        that depends on the algorithm asks it."""
        return ALGORITHMS[self.algorithm.name.value]

    def roles(self) -> dict[str, MegatronConfig]:
        """Megatron blocks of the roles that exist in this job, keyed by their config path, in build order
        (the recipes build these: trinity.trainer.recipes.Recipe.roles)."""
        out = {"actor_rollout_ref.actor": self.actor_rollout_ref.actor.megatron}
        # with LoRA the reference policy is the actor with its adapters off: no ref model is built
        if self.needs_ref and self.actor_rollout_ref.actor.lora.rank == 0:
            out["actor_rollout_ref.ref"] = self.actor_rollout_ref.ref.megatron
        if self.needs_critic and self.critic is not None:
            out["critic"] = self.critic.megatron
        return out

    @model_validator(mode="before")
    @classmethod
    def _algorithm_defaults(cls, data: Any) -> Any:
        """The defaults an algorithm changes (AlgorithmSpec.defaults) where the config leaves them unset;
        an explicit value stands. pt and dpo: data.packing false (see its docstring; an explicit true is
        refused for dpo); reinforce_plus_plus: algorithm.use_kl_in_reward true."""
        if not isinstance(data, dict):
            return data
        algo = data.get("algorithm")
        name = algo.get("name") if isinstance(algo, dict) else None
        spec = ALGORITHMS.get(getattr(name, "value", name)) if isinstance(name, str) else None
        for key, value in spec.defaults if spec is not None else ():
            data = _set_unset(data, key.split("."), value)
        return data

    @property
    def workflow_context_tokens(self) -> int:
        """The context limit of a workflow's conversations: workflow.context_tokens, else the RL sequence
        length (data.max_prompt_length + rollout.response_length)."""
        explicit = self.workflow.context_tokens if self.workflow is not None else None
        return explicit or self.data.max_prompt_length + self.actor_rollout_ref.rollout.response_length

    @property
    def needs_ref(self) -> bool:
        """The reference model exists for RL jobs that use KL, and for dpo (the frozen initial policy)."""
        kl = self.actor_rollout_ref.actor.use_kl_loss or self.algorithm.use_kl_in_reward
        return self.spec.uses_ref(kl)

    @property
    def needs_critic(self) -> bool:
        """The critic (value model) exists for ppo only."""
        return self.spec.critic

    @property
    def is_rl(self) -> bool:
        """Whether the job generates rollouts (dpo trains offline on pairs, like SFT: not RL here)."""
        return self.spec.rollout


def _set_unset(data: dict[str, Any], path: list[str], value: bool) -> dict[str, Any]:
    """`data` with `value` at `path` where that key is unset (a copy; a block that is not a mapping is
    left for validation to report)."""
    head, rest = path[0], path[1:]
    if not rest:
        return data if head in data else {**data, head: value}
    section = data.get(head)
    if section is None:
        section = {}
    if not isinstance(section, dict):
        return data
    return {**data, head: _set_unset(section, rest, value)}
