"""PPO-clip policy loss (dual clip), GSPO's sequence-level variant, entropy bonus, KL loss, clipped value loss, loss aggregation.

Token losses are `[batch, response_len]` matrices with a 0/1 response mask; `agg_loss` turns them into
one number. Names follow verl (`clip_ratio_low`, `clip_ratio_high`, `clip_ratio_c`, `cliprange_value`,
`loss_agg_mode`).

Global normalisation across micro batches (gradient accumulation)
-----------------------------------------------------------------
Every aggregation mode is `numerator / denominator`, both sums over the batch:
  token-mean           sum of masked token losses        / number of masked tokens
  seq-mean-token-sum   sum over sequences of token sums  / number of sequences (with >= 1 token)
  seq-mean-token-mean  sum over sequences of token means / number of sequences (with >= 1 token)
Averaging per-micro-batch means is NOT the full-batch mean when micro batches hold different token
counts. To get the full-batch loss exactly:
  1. D = `global_agg_denominator(masks_of_all_micro_batches, mode, dp_group)` once per optimizer step
     (sums `agg_denominator` over the step's micro batches and all-reduces over data-parallel ranks);
  2. each micro batch's loss is `agg_loss(loss_mat, mask, mode, denominator=D)`;
  3. the sum of these over micro batches and DP ranks is then the full-batch loss. Backends that
     average instead of sum must be undone: megatron DDP averages gradients over DP ranks (multiply each
     micro loss by dp_size) and megatron's `forward_backward_func` divides a `(loss, metrics)` loss
     function's loss by num_microbatches (multiply by num_microbatches). `test_algorithms_losses.py`
     checks that summed micro-batch gradients equal full-batch gradients for every mode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from trinity.algorithms.advantages import masked_mean
from trinity.algorithms.kl import token_kl
from trinity.algorithms.modes import KLEstimator, LossAggMode
from trinity.distributed import collectives

if TYPE_CHECKING:
    from trinity.config.schema import ActorConfig


def _seq_has_tokens(mask: torch.Tensor) -> torch.Tensor:
    return (mask.sum(-1) > 0).to(mask.dtype)


def _token_sum(loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (loss_mat * mask).sum()


def _seq_token_mean_sum(loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    per_seq = (loss_mat * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_seq.sum()


# mode -> (numerator, denominator) as functions of (loss_mat, mask) / (mask)
_AGG: dict[LossAggMode, tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]] = {
    LossAggMode.token_mean: (_token_sum, lambda mask: mask.sum()),
    LossAggMode.seq_mean_token_sum: (_token_sum, lambda mask: _seq_has_tokens(mask).sum()),
    LossAggMode.seq_mean_token_mean: (_seq_token_mean_sum, lambda mask: _seq_has_tokens(mask).sum()),
}


def agg_denominator(loss_mask: torch.Tensor, mode: LossAggMode | str) -> torch.Tensor:
    """What this (micro) batch adds to the denominator of `mode` (tokens or sequences), fp32."""
    return _AGG[LossAggMode(mode)][1](loss_mask.float())


def global_agg_denominator(
    masks: Iterable[torch.Tensor], mode: LossAggMode | str, group: object | None = None
) -> torch.Tensor:
    """Denominator of the whole step: summed over micro-batch masks, all-reduced over `group` (DP)."""
    total = sum((agg_denominator(m, mode) for m in masks), torch.zeros(()))
    return total if group is None else collectives.all_reduce(total, group=group)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: LossAggMode | str,
    denominator: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """One loss value from token losses; `denominator` (see module doc) defaults to this batch's own."""
    numerator_fn, denominator_fn = _AGG[LossAggMode(mode)]
    mask = loss_mask.to(loss_mat.dtype)
    if denominator is None:
        denominator = denominator_fn(mask)
    if isinstance(denominator, torch.Tensor):
        denominator = denominator.to(loss_mat.device, loss_mat.dtype).clamp(min=1)
    else:
        denominator = max(float(denominator), 1.0)
    return numerator_fn(loss_mat, mask) / denominator


@dataclass(frozen=True)
class PolicyLossMetrics:
    """Detached 0-d tensors (no host sync); masked means over this batch's response tokens."""

    pg_clipfrac: torch.Tensor  # fraction of tokens where the ratio clip was active
    ppo_kl: torch.Tensor  # mean of old_logp - logp (approximate KL(old || new))
    pg_clipfrac_lower: torch.Tensor  # fraction of negative-advantage tokens capped by clip_ratio_c


def ppo_policy_loss(
    old_logp: torch.Tensor,
    logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: LossAggMode | str = LossAggMode.token_mean,
    denominator: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, PolicyLossMetrics]:
    """PPO-clip: max(-A r, -A clip(r, 1 - low, 1 + high)), and for A < 0 at most -A * clip_ratio_c.

    The dual clip (Ye et al. 2020) bounds the loss of tokens whose ratio exploded on a negative
    advantage; `clip_ratio_c=None` turns it off.
    """
    mask = response_mask.to(torch.float32)
    log_ratio = torch.clamp(logp.float() - old_logp.float(), min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    advantages = advantages.float()

    pg_losses, clipfrac, clipfrac_lower = _clipped_pg_losses(
        ratio, advantages, mask, clip_ratio_low, clip_ratio_high, clip_ratio_c)
    loss = agg_loss(pg_losses, mask, loss_agg_mode, denominator)
    metrics = PolicyLossMetrics(
        pg_clipfrac=clipfrac.detach(),
        ppo_kl=masked_mean(-log_ratio, mask).detach(),
        pg_clipfrac_lower=clipfrac_lower.detach(),
    )
    return loss, metrics


def _clipped_pg_losses(
    ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO-clip per token on `ratio` (token ratios for PPO, the sequence ratio for GSPO), with the dual clip
    `clip_ratio_c` capping negative advantages; returns (losses, clip fraction, lower clip fraction)."""
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), mask)
    if clip_ratio_c is None:
        return loss_ppo, clipfrac, torch.zeros((), device=mask.device)
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1, got {clip_ratio_c}")
    loss_cap = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(loss_ppo, loss_cap), loss_ppo)
    return pg_losses, clipfrac, masked_mean(((loss_ppo > loss_cap) & negative).float(), mask)


def gspo_policy_loss(
    old_logp: torch.Tensor,
    logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: LossAggMode | str = LossAggMode.seq_mean_token_mean,
    denominator: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, PolicyLossMetrics]:
    """GSPO (Zheng et al. 2025, verl's `policy_loss.loss_mode: gspo`): PPO-clip on the sequence-level ratio
    s_i = exp(mean over the response of (logp - old_logp)), the geometric mean of the token ratios.

    As in verl, every token of sequence i carries s_i,t = sg[s_i] * exp(logp_t - sg[logp_t]): its value is
    s_i (so the clip is decided per sequence, with GSPO's small ranges, e.g. 3e-4 / 4e-4) and its gradient
    is s_i * d logp_t, whose mean over the response is d s_i. log s_i is clamped at 10 as in verl. The dual
    clip (`clip_ratio_c`) caps negative-advantage sequences as in `ppo_policy_loss` (verl's gspo has none:
    `clip_ratio_c: null` gives its loss exactly).
    """
    mask = response_mask.to(torch.float32)
    logp, old_logp, advantages = logp.float(), old_logp.float(), advantages.float()
    log_ratio = logp - old_logp
    seq_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    log_s = torch.clamp(logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1), max=10.0)
    ratio = torch.exp(log_s)
    pg_losses, clipfrac, clipfrac_lower = _clipped_pg_losses(
        ratio, advantages, mask, clip_ratio_low, clip_ratio_high, clip_ratio_c)
    loss = agg_loss(pg_losses, mask, loss_agg_mode, denominator)
    metrics = PolicyLossMetrics(
        pg_clipfrac=clipfrac.detach(),
        ppo_kl=masked_mean(-log_ratio, mask).detach(),
        pg_clipfrac_lower=clipfrac_lower.detach(),
    )
    return loss, metrics


class PolicyLossFn(Protocol):
    """A policy loss: (old_logp, logp, advantages, response_mask, clip_ratio_low, clip_ratio_high,
    clip_ratio_c, loss_agg_mode, denominator) -> (loss, metrics), as `ppo_policy_loss`."""

    def __call__(self, old_logp: torch.Tensor, logp: torch.Tensor, advantages: torch.Tensor,
                 response_mask: torch.Tensor, clip_ratio_low: float, clip_ratio_high: float,
                 clip_ratio_c: float | None, loss_agg_mode: LossAggMode | str,
                 denominator: torch.Tensor | float | None, /) -> tuple[torch.Tensor, PolicyLossMetrics]: ...


# actor_rollout_ref.actor.policy_loss.loss_mode -> policy loss (verl's register_policy_loss names)
POLICY_LOSSES: dict[str, PolicyLossFn] = {"vanilla": ppo_policy_loss, "gspo": gspo_policy_loss}


def entropy_loss(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: LossAggMode | str = LossAggMode.token_mean,
    denominator: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Aggregated token entropy; the actor loss subtracts entropy_coeff times this (a bonus)."""
    return agg_loss(entropy.float(), response_mask, loss_agg_mode, denominator)


def kl_loss(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    response_mask: torch.Tensor,
    kind: KLEstimator | str = KLEstimator.low_var_kl,
    loss_agg_mode: LossAggMode | str = LossAggMode.token_mean,
    denominator: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Aggregated KL(actor || ref) for `use_kl_loss`; gradients flow into logp only."""
    return agg_loss(token_kl(logp, ref_logp.detach(), kind), response_mask, loss_agg_mode, denominator)


def truncated_is_weights(old_logp: torch.Tensor, behaviour_logp: torch.Tensor, response_mask: torch.Tensor,
                         cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level truncated importance weights (TIS, verl's `rollout_is`): w = min(exp(old_logp -
    behaviour_logp), cap) per response token, 0 on padding, detached; and the untruncated ratio (for the
    metrics). `old_logp`: the policy the update starts from; `behaviour_logp`: the one that sampled the
    token (partial rollouts: an older version for carried-over tokens)."""
    mask = response_mask.float()
    ratio = torch.exp(torch.clamp(old_logp.float() - behaviour_logp.float(), min=-20.0, max=20.0)).detach() * mask
    return torch.clamp(ratio, max=cap), ratio


def actor_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    actor: ActorConfig,
    entropy: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    denominator: torch.Tensor | float | None = None,
    policy_loss: PolicyLossFn | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """pg_loss - entropy_coeff * entropy + kl_loss_coef * KL (when use_kl_loss), with the actor's
    settings; metrics (detached, verl's names) for logging. `policy_loss`: an algorithm's own (CISPO's),
    else the one actor.policy_loss.loss_mode names. `is_weights` (>= 0, detached; `truncated_is_weights`)
    multiply each token's policy loss: they scale the advantages, which is the same since every policy
    loss here is positively homogeneous in the advantage per token (PPO-clip and its dual clip, GSPO's
    and CISPO's terms are A times a function of the ratio)."""
    mode = actor.loss_agg_mode
    if is_weights is not None:
        advantages = advantages * is_weights
    loss, pg = (policy_loss or POLICY_LOSSES[actor.policy_loss.loss_mode])(
        old_logp, logp, advantages, response_mask, actor.clip_ratio_low, actor.clip_ratio_high,
        actor.clip_ratio_c, mode, denominator,
    )
    metrics = {
        "actor/pg_loss": loss.detach(),
        "actor/pg_clipfrac": pg.pg_clipfrac,
        "actor/ppo_kl": pg.ppo_kl,
        "actor/pg_clipfrac_lower": pg.pg_clipfrac_lower,
    }
    if actor.entropy_coeff > 0 and entropy is None:
        raise ValueError("entropy_coeff > 0 needs the token entropy")
    if entropy is not None:
        ent = entropy_loss(entropy, response_mask, mode, denominator)
        metrics["actor/entropy"] = ent.detach()
        if actor.entropy_coeff > 0:
            loss = loss - actor.entropy_coeff * ent
    if actor.use_kl_loss:
        if ref_logp is None:
            raise ValueError("use_kl_loss needs the reference log-probs")
        kl = kl_loss(logp, ref_logp, response_mask, actor.kl_loss_type, mode, denominator)
        metrics["actor/kl_loss"] = kl.detach()
        loss = loss + actor.kl_loss_coef * kl
    return loss, metrics


@dataclass(frozen=True)
class ValueLossMetrics:
    vf_clipfrac: torch.Tensor  # fraction of tokens where the clipped prediction had the larger error
    vpred_mean: torch.Tensor


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float = 0.5,
    loss_agg_mode: LossAggMode | str = LossAggMode.token_mean,
    denominator: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, ValueLossMetrics]:
    """0.5 * agg(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)), as in verl/PPO2."""
    mask = response_mask.to(torch.float32)
    values, old_values, returns = values.float(), old_values.float(), returns.float()
    clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    err_unclipped = (values - returns).square()
    err_clipped = (clipped - returns).square()
    loss = 0.5 * agg_loss(torch.maximum(err_unclipped, err_clipped), mask, loss_agg_mode, denominator)
    metrics = ValueLossMetrics(
        vf_clipfrac=masked_mean((err_clipped > err_unclipped).float(), mask).detach(),
        vpred_mean=masked_mean(values, mask).detach(),
    )
    return loss, metrics
