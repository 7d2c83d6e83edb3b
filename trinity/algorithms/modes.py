"""The algorithms' modes that the config names (`actor_rollout_ref.actor.loss_agg_mode`, `kl_loss_type`,
`algorithm.kl_penalty`): defined here, with the code that runs them, and read by the config schema."""

from __future__ import annotations

import enum


class KLEstimator(str, enum.Enum):
    """Token-level KL estimators (names as in verl)."""

    kl = "kl"  # k1: logp - ref_logp
    abs = "abs"
    mse = "mse"  # k2
    low_var_kl = "low_var_kl"  # k3, clamped


class LossAggMode(str, enum.Enum):
    token_mean = "token-mean"
    seq_mean_token_sum = "seq-mean-token-sum"
    seq_mean_token_mean = "seq-mean-token-mean"
