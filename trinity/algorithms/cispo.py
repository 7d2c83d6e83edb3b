"""CISPO (MiniMax-M1, Chen et al. 2025, arXiv:2506.13585): clipped importance-sampling-weight policy
optimisation. `algorithm.name: cispo` is GRPO's group advantages with this loss (trinity.algorithms.registry).

PPO-clip drops the gradient of a token whose ratio left the clip range (the clipped branch is a constant),
and the tokens it drops are often the rare ones that start a reflection ("However", "Wait"). CISPO clips
the importance-sampling weight instead and stops its gradient:

    loss_t = -sg(clip(r_t, 1 - clip_ratio_low, 1 + clip_ratio_high)) * A_t * log pi(o_t)

so every token keeps a gradient, A_t * clipped weight * d log pi, bounded by the clipped weight.
As verl's `compute_policy_loss_cispo` (verl/trainer/ppo/core_algos.py, `policy_loss.loss_mode: cispo`): the
actor's clip_ratio_low / clip_ratio_high bound the weight, log r is clamped to [-20, 20], the loss is
aggregated with loss_agg_mode, and pg_clipfrac counts the tokens whose weight was clipped. The paper
leaves the weight without a lower bound (clip_ratio_low: 1 gives that: the weight stays >= 0) and tunes
only the upper one. The dual clip (clip_ratio_c) bounds a PPO surrogate that CISPO does not have.
"""

from __future__ import annotations

import torch

from trinity.algorithms.advantages import masked_mean
from trinity.algorithms.losses import PolicyLossMetrics, agg_loss
from trinity.algorithms.modes import LossAggMode


def cispo_policy_loss(
    old_logp: torch.Tensor,
    logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = None,
    loss_agg_mode: LossAggMode | str = LossAggMode.token_mean,
    denominator: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, PolicyLossMetrics]:
    """-sg(clip(r, 1 - low, 1 + high)) * A * logp per token, aggregated; `clip_ratio_c` is not used (the
    spec's `ignores` refuses it at validate). pg_clipfrac_lower is 0: CISPO has no dual clip."""
    mask = response_mask.to(torch.float32)
    logp, advantages = logp.float(), advantages.float()
    log_ratio = torch.clamp(logp - old_logp.float(), min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high).detach()
    pg_losses = -weight * advantages * logp
    loss = agg_loss(pg_losses, mask, loss_agg_mode, denominator)
    metrics = PolicyLossMetrics(
        pg_clipfrac=masked_mean((ratio.detach() != weight).float(), mask).detach(),
        ppo_kl=masked_mean(-log_ratio, mask).detach(),
        pg_clipfrac_lower=torch.zeros((), device=mask.device),
    )
    return loss, metrics
