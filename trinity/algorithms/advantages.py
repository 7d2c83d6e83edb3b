"""Advantages for RL: GRPO group-normalised outcome advantages, PPO GAE, masked whitening.

Shapes: `[batch, response_len]` for token-level tensors, `[batch]` for per-sequence ones. The
response mask is 1 on response tokens that count and 0 on padding (and on tool/observation tokens in
multi-turn rollouts). Names and conventions follow verl so that its users recognise them; where verl's
behaviour is surprising it is kept and said so, because users compare curves against verl runs.

Call these on the whole rollout batch of a rank, not on micro batches: group statistics and whitening are
batch statistics. GRPO groups must be local to the rank (trinity samples all `n` answers of a prompt on
one rank); whitening takes an optional process group (the data-parallel group) and then uses the mean
and variance of every rank's batch, so the result does not depend on how the batch is split.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from trinity.distributed import collectives

if TYPE_CHECKING:
    from trinity.config.schema import AlgorithmConfig


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    return (values * mask).sum() if dim is None else (values * mask).sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over mask == 1 entries; an all-zero mask gives 0 rather than NaN."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over mask == 1 entries (Bessel-corrected by default, as verl does)."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        var = var * count / (count - 1).clamp(min=1)
    return var


def masked_moments(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[sum, sum of squares, count] of the masked entries, float64: what ranks all-reduce to whiten globally."""
    v = values.double()
    m = mask.to(torch.float64)
    return torch.stack([(v * m).sum(), (v * v * m).sum(), m.sum()])


def mean_var_from_moments(moments: torch.Tensor, unbiased: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and variance (Bessel-corrected by default, as masked_var) from summed `masked_moments`."""
    total, total_sq, count = moments.unbind()
    n = count.clamp(min=1)
    mean = total / n
    var = ((total_sq - total * mean) / n).clamp(min=0)
    if unbiased:
        var = var * count / (count - 1).clamp(min=1)
    return mean, var


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8, group: Any = None
) -> torch.Tensor:
    """(values - mean) / std over the masked entries; masked-out entries are zeroed.

    With shift_mean=False the mean is added back (only the scale changes), as verl allows.
    group: a torch.distributed process group (the data-parallel group): mean and variance are those of the
    masked entries of every rank in it (one all-reduce of sum, sum of squares and count, in float64).
    None, or a group of one rank: this tensor alone, computed two-pass in its own dtype.
    """
    if group is not None and dist.get_world_size(group) > 1:
        moments = collectives.all_reduce(masked_moments(values, mask), group=group)
        mean64, var64 = mean_var_from_moments(moments)
        mean, var = mean64.to(values.dtype), var64.to(values.dtype)
    else:
        mean = masked_mean(values, mask)
        var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


def _group_index(group_ids: torch.Tensor | Sequence[object], batch: int) -> torch.Tensor:
    """Dense 0..G-1 group index per sample from any hashable ids (uids, prompt indices)."""
    if isinstance(group_ids, torch.Tensor):
        if group_ids.shape != (batch,):
            raise ValueError(f"group_ids has shape {tuple(group_ids.shape)}, expected ({batch},)")
        _, dense = torch.unique(group_ids, return_inverse=True)
        return dense
    ids = list(group_ids)
    if len(ids) != batch:
        raise ValueError(f"group_ids has {len(ids)} entries, expected {batch}")
    first_seen: dict[object, int] = {}
    return torch.tensor([first_seen.setdefault(g, len(first_seen)) for g in ids], dtype=torch.long)


def _group_sums(scores: torch.Tensor, group_ids: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(scores as fp32, group index per sample, samples per group, score sum per group, number of groups)."""
    scores = scores.float()
    batch = scores.shape[0]
    index = _group_index(group_ids, batch).to(scores.device)
    num_groups = int(index.max().item()) + 1 if batch else 0
    count = torch.zeros(num_groups, device=scores.device).index_add_(0, index, torch.ones_like(scores))
    total = torch.zeros(num_groups, device=scores.device).index_add_(0, index, scores)
    return scores, index, count, total, num_groups


def grpo_outcome_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor | Sequence[object],
    response_mask: torch.Tensor,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantages, broadcast over the response tokens.

    scores: `[batch]` sequence rewards (sum the token rewards first if you have those).
    group_ids: one id per sample; samples answering the same prompt share an id.
    Per group: adv = (score - mean) / (std + epsilon), std unbiased (torch.std), or
    adv = score - mean without std division (Dr. GRPO).
    As in verl, a group with a single sample keeps its raw score (mean 0, std 1).

    Returns (advantages, returns), both `[batch, response_len]`, equal, zero where the mask is 0.
    """
    scores, index, count, total, num_groups = _group_sums(scores, group_ids)
    mean = total / count
    sq_dev = torch.zeros(num_groups, device=scores.device).index_add_(0, index, (scores - mean[index]) ** 2)
    std = torch.sqrt(sq_dev / (count - 1).clamp(min=1))
    singleton = count == 1
    mean = torch.where(singleton, torch.zeros_like(mean), mean)
    std = torch.where(singleton, torch.ones_like(std), std)

    centred = scores - mean[index]
    adv = centred / (std[index] + epsilon) if norm_adv_by_std_in_grpo else centred
    adv = adv.unsqueeze(-1) * response_mask.to(adv.dtype)
    return adv, adv


def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
    group: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO generalised advantage estimation over `[batch, response_len]` tokens.

    delta_t = r_t + gamma * V_{t+1} - V_t;  A_t = delta_t + gamma * lam * A_{t+1};  V after the last
    token is 0. Masked-out positions are skipped (their V and A pass through unchanged to the previous
    counted token), so mask holes inside a response (multi-turn observations) do not break the chain.
    returns = A + V (before whitening); advantages are whitened over the mask when `whiten` is set, over
    every rank of `group` when one is given (see masked_whiten).
    """
    token_rewards = token_rewards.float()
    values = values.float()
    mask = response_mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    reversed_adv = []
    for t in reversed(range(values.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        m = mask[:, t]
        next_value = values[:, t] * m + next_value * (1 - m)
        next_adv = adv_t * m + next_adv * (1 - m)
        reversed_adv.append(next_adv)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    returns = advantages + values
    if whiten:
        advantages = masked_whiten(advantages, mask, group=group)
    return advantages * mask, returns * mask


def rloo_outcome_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor | Sequence[object], response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (REINFORCE leave-one-out, Ahmadian et al. 2024): adv_i = r_i - mean of the other n-1 rewards of
    its group, which equals n / (n - 1) * (r_i - group mean) (verl's `rloo` computes it that way).

    The baseline of a sample does not depend on its own reward, so the estimate stays unbiased. A group
    of one sample keeps its raw score (no other sample to compare with; as in verl): trinity refuses
    rollout.n < 2 for rloo before the job starts.

    Returns (advantages, returns), both `[batch, response_len]`, equal, zero where the mask is 0.
    """
    scores, index, count, total, num_groups = _group_sums(scores, group_ids)
    others = (count[index] - 1).clamp(min=1)
    baseline = (total[index] - scores) / others
    adv = torch.where(count[index] > 1, scores - baseline, scores)
    adv = adv.unsqueeze(-1) * response_mask.to(adv.dtype)
    return adv, adv


def reinforce_plus_plus_advantages(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0, group: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, verl's `reinforce_plus_plus`): the return of each token is the discounted sum
    of the token rewards from it to the end of its response (the outcome score on the last token minus
    the per-token KL penalty when `use_kl_in_reward` is on), and the advantages are these returns whitened
    over the whole batch: a global baseline, over every rank of `group` (the DP group) when one is given.

    The running return restarts after a masked-out token, as in verl. Returns (advantages, returns).
    """
    token_rewards = token_rewards.float()
    mask = response_mask.to(token_rewards.dtype)
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    advantages = masked_whiten(returns, mask, group=group)
    return advantages * mask, returns


class Estimator(Protocol):
    def __call__(self, token_rewards: torch.Tensor, groups: Sequence[int], mask: torch.Tensor,
                 values: torch.Tensor | None, algo: AlgorithmConfig, group: Any, /) -> tuple[torch.Tensor, torch.Tensor]:
        """(advantages, returns) of a rollout batch from its token rewards (the outcome score on each
        response's last token, minus any in-reward KL penalty); `groups`: a prompt id per response, `values`:
        the critic's, `group`: the DP process group (None at DP 1)."""


# AlgorithmSpec.advantages -> estimator, with the settings of the `algorithm:` block
ESTIMATORS: dict[str, Estimator] = {
    "grpo": lambda r, groups, mask, values, algo, group: grpo_outcome_advantages(
        r.sum(-1), groups, mask, algo.norm_adv_by_std_in_grpo),
    "rloo": lambda r, groups, mask, values, algo, group: rloo_outcome_advantages(r.sum(-1), groups, mask),
    "gae": lambda r, groups, mask, values, algo, group: gae_advantages(
        r, values, mask, algo.gamma, algo.lam, group=group),
    "reinforce_plus_plus": lambda r, groups, mask, values, algo, group: reinforce_plus_plus_advantages(
        r, mask, algo.gamma, group=group),
}
