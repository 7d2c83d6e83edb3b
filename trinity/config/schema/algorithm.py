"""The `algorithm:` block: which algorithm runs, its advantage / KL-in-reward settings, and the enums of
the algorithm options that other blocks share (KL estimators, loss aggregation).
"""

from __future__ import annotations

import enum
from typing import Literal

from pydantic import Field

from trinity.algorithms.modes import KLEstimator, LossAggMode  # noqa: F401 (the fields' types)
from trinity.algorithms.registry import ALGORITHMS
from trinity.config.megatron import StrictModel


# algorithm.name's choices: the algorithms of trinity.algorithms.registry, in its order.
AlgorithmName = enum.Enum("AlgorithmName", [(n, n) for n in ALGORITHMS], type=str, module=__name__)


class DPOLossType(str, enum.Enum):
    """DPO loss variants (TRL's `loss_type` names; trinity.algorithms.dpo)."""

    sigmoid = "sigmoid"  # DPO (Rafailov et al. 2023); with label_smoothing > 0, conservative DPO
    ipo = "ipo"  # IPO (Azar et al. 2023)
    robust = "robust"  # robust DPO (Chowdhury et al. 2024)


class FilterGroupsConfig(StrictModel):
    """DAPO's dynamic sampling (verl's `algorithm.filter_groups`)."""

    enable: bool = False
    """dapo: drop the prompt groups whose `metric` is equal for all rollout.n responses and draw more
    prompts until data.train_batch_size groups are left (docs/rl.md)."""
    metric: Literal["score", "seq_reward"] = "seq_reward"
    """What must vary within a group: `score` (the reward function's value) or `seq_reward` (score plus the
    overlong penalty). verl's `acc` (a reward returning an accuracy beside the score) and
    `seq_final_reward` (after the in-reward KL penalty, known only after the ref forward) are not available."""
    max_num_gen_batches: int = 10
    """Most batches of data.train_batch_size prompts drawn for one step (<= 0: no limit, as in verl);
    when they do not yield enough varied groups the step trains on the kept groups filled up with dropped
    ones (equal rewards: zero advantage), and metrics.jsonl says so (dapo/filled_groups)."""


class DPOConfig(StrictModel):
    """DPO's settings (algorithm.name: dpo), named as in TRL's DPOConfig."""

    beta: float = Field(default=0.1, gt=0.0)
    """Strength of the implicit KL to the reference: the loss compares beta x (policy - ref log-prob
    margins); higher keeps the policy closer to the reference (TRL's default 0.1)."""
    loss_type: DPOLossType = DPOLossType.sigmoid
    """`sigmoid` (DPO), `ipo` (squared loss towards a margin of 1 / (2 beta)) or `robust` (robust DPO
    for noisy preference labels); docs/rl.md."""
    label_smoothing: float = Field(default=0.0, ge=0.0, lt=0.5)
    """Assumed probability that a pair's preference label is flipped (sigmoid: conservative DPO;
    robust: the noise rate); 0 is plain DPO. ipo takes none (refused)."""


class AlgorithmConfig(StrictModel):
    """Which fine-tuning algorithm runs, and its advantage / KL-in-reward settings."""

    name: AlgorithmName = AlgorithmName.sft
    """`sft` (supervised), `pt` (continued pre-training on raw text: loss on every token;
    docs/pretraining.md), `grpo` (group-relative policy optimisation), `ppo` (with a critic), `rloo`
    (leave-one-out baseline), `reinforce_plus_plus` (global baseline, KL in the reward), `dapo` (GRPO with
    dynamic sampling and overlong shaping), `dpo` (direct preference optimisation on chosen/rejected
    pairs, against the frozen initial policy as reference) or `cispo` (GRPO's advantages with MiniMax-M1's
    clipped importance-weight loss); docs/rl.md. GSPO is a policy loss:
    actor_rollout_ref.actor.policy_loss.loss_mode: gspo."""
    gamma: float = Field(default=1.0, ge=0.0, le=1.0)
    """PPO: discount factor of GAE; reinforce_plus_plus: discount of the returns."""
    lam: float = Field(default=1.0, ge=0.0, le=1.0)
    """PPO: lambda of GAE."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide group-centred rewards by the group's standard deviation."""
    use_kl_in_reward: bool = False
    """Subtract kl_coef x KL(actor || ref) from the token rewards (needs the ref role)."""
    kl_penalty: KLEstimator = KLEstimator.kl
    """KL estimator used for the in-reward penalty."""
    kl_coef: float = Field(default=0.001, ge=0.0)
    """Coefficient of the in-reward KL penalty."""
    filter_groups: FilterGroupsConfig = Field(default_factory=FilterGroupsConfig)
    """dapo: dynamic sampling."""
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    """dpo: beta, loss type and label smoothing."""
