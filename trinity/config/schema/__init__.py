"""The job config: one Pydantic model per section, every field documented.

Sections: algorithm, model, data, cluster, trainer, actor_rollout_ref (actor, ref, rollout), critic,
reward. Field docstrings are the reference documentation (docs/configuration.md is generated from
them) and the JSON Schema descriptions (`trinity schema`).

Each block is defined in the module of its name (`algorithm`, `model`, `data`, `cluster`, `trainer`,
`actor_rollout_ref`, `critic`, `reward` with verl's `reward_model`; `optim` is shared by actor and critic,
the roles' `megatron:` block is trinity.config.megatron) and the root, `JobConfig`, in `job`. Import them
from here: `from trinity.config.schema import JobConfig, OptimConfig`.
"""

from __future__ import annotations

from trinity.config.megatron import MegatronConfig, StrictModel
from trinity.config.schema.actor_rollout_ref import (
    ActorConfig,
    ActorRolloutRefConfig,
    LoraConfig,
    PolicyLossConfig,
    RefConfig,
    RolloutConfig,
    VerlProfileConfig,
    VerlProfilerConfig,
)
from trinity.config.schema.algorithm import (
    AlgorithmConfig,
    AlgorithmName,
    DPOConfig,
    DPOLossType,
    FilterGroupsConfig,
    KLEstimator,
    LossAggMode,
)
from trinity.config.schema.cluster import ClusterConfig
from trinity.config.schema.critic import CriticConfig
from trinity.config.schema.data import DataConfig, split_train_files
from trinity.config.schema.job import JobConfig
from trinity.config.schema.model import ModelConfig
from trinity.config.schema.optim import OptimConfig
from trinity.config.schema.reward import OverlongBufferConfig, RewardConfig, RewardModelConfig
from trinity.config.schema.trainer import TrainerConfig

__all__ = [
    "ActorConfig",
    "ActorRolloutRefConfig",
    "AlgorithmConfig",
    "AlgorithmName",
    "ClusterConfig",
    "CriticConfig",
    "DPOConfig",
    "DPOLossType",
    "DataConfig",
    "FilterGroupsConfig",
    "JobConfig",
    "KLEstimator",
    "LoraConfig",
    "LossAggMode",
    "MegatronConfig",
    "ModelConfig",
    "OptimConfig",
    "OverlongBufferConfig",
    "PolicyLossConfig",
    "RefConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "StrictModel",
    "TrainerConfig",
    "VerlProfileConfig",
    "VerlProfilerConfig",
    "split_train_files",
]
