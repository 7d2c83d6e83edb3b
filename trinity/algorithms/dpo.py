"""Direct preference optimisation (DPO) and its IPO / robust variants, on sequence log-probabilities.

Inputs are per-pair sums of response-token log-probs under the policy and the frozen reference:
`chosen`, `rejected`, `ref_chosen`, `ref_rejected` (each [pairs], fp32). With
h = (chosen - ref_chosen) - (rejected - ref_rejected):
  sigmoid (DPO, Rafailov et al. 2023; with label smoothing e, cDPO):
      -(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h)
  ipo (Azar et al. 2023):       (h - 1 / (2 beta))^2
  robust (Chowdhury et al. 2024): (-(1 - e) log sigmoid(beta h) + e log sigmoid(-beta h)) / (1 - 2e)
The implicit rewards are beta (policy - ref) per response; accuracy is the share of pairs whose chosen
reward exceeds the rejected one. Names follow TRL (`beta`, `label_smoothing`, `loss_type`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOSS_TYPES = ("sigmoid", "ipo", "robust")


@dataclass
class DPOMetrics:
    chosen_reward: torch.Tensor  # [pairs], detached
    rejected_reward: torch.Tensor
    margin: torch.Tensor
    accuracy: torch.Tensor  # [pairs], 1.0 where chosen_reward > rejected_reward


def dpo_loss(
    chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, *,
    beta: float, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, DPOMetrics]:
    """Per-pair losses [pairs] (the caller averages them over the global batch) and the pair metrics."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type {loss_type!r} is not one of {LOSS_TYPES}")
    h = (chosen - ref_chosen) - (rejected - ref_rejected)
    e = label_smoothing
    if loss_type == "sigmoid":
        losses = -(1 - e) * F.logsigmoid(beta * h) - e * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        losses = (-(1 - e) * F.logsigmoid(beta * h) + e * F.logsigmoid(-beta * h)) / (1 - 2 * e)
    chosen_reward = beta * (chosen - ref_chosen).detach()
    rejected_reward = beta * (rejected - ref_rejected).detach()
    return losses, DPOMetrics(chosen_reward, rejected_reward, chosen_reward - rejected_reward,
                              (chosen_reward > rejected_reward).float())
