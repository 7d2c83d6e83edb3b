"""Token-wise KL(actor || ref) estimators from log-probs of the sampled tokens, and the KL reward penalty.

With r = ref_logp - logp on tokens sampled from the actor (Schulman, "Approximating KL divergence"):
  kl (k1)          logp - ref_logp                    unbiased, high variance, can be negative
  abs              |logp - ref_logp|
  mse (k2)         0.5 * (logp - ref_logp)^2
  low_var_kl (k3)  exp(r) - r - 1, r clamped to [-20, 20], result clamped to [-10, 10] (as verl)
The estimator names are the config's `KLEstimator` values; `k1`/`k2`/`k3` are accepted aliases.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trinity.algorithms.modes import KLEstimator

KLFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


def _abs(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return (logp - ref_logp).abs()


def _k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp).square()


def _k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    # The clamps keep exp() finite when the policies have drifted far apart on a token.
    log_ratio = torch.clamp(ref_logp - logp, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, min=-10.0, max=10.0)


KL_ESTIMATORS: dict[KLEstimator, KLFn] = {
    KLEstimator.kl: _k1,
    KLEstimator.abs: _abs,
    KLEstimator.mse: _k2,
    KLEstimator.low_var_kl: _k3,
}

_ALIASES: dict[str, KLEstimator] = {"k1": KLEstimator.kl, "k2": KLEstimator.mse, "k3": KLEstimator.low_var_kl}


def kl_estimator(kind: KLEstimator | str) -> KLEstimator:
    """The estimator named by a config value or an alias (k1/k2/k3)."""
    if isinstance(kind, KLEstimator):
        return kind
    if kind in _ALIASES:
        return _ALIASES[kind]
    try:
        return KLEstimator(kind)
    except ValueError:
        names = [e.value for e in KLEstimator] + list(_ALIASES)
        raise ValueError(f"unknown KL estimator {kind!r}; known: {', '.join(names)}") from None


def token_kl(logp: torch.Tensor, ref_logp: torch.Tensor, kind: KLEstimator | str) -> torch.Tensor:
    """Per-token KL estimate, same shape as the inputs (computed in fp32)."""
    return KL_ESTIMATORS[kl_estimator(kind)](logp.float(), ref_logp.float())


def apply_kl_penalty(
    token_rewards: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    coef: float,
    kind: KLEstimator | str,
    response_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """token_rewards - coef * KL per token (KL zeroed where response_mask is 0).

    The KL is a reward here, so no gradient flows into logp/ref_logp (they are detached).
    """
    kl = token_kl(logp.detach(), ref_logp.detach(), kind)
    if response_mask is not None:
        kl = kl * response_mask.to(kl.dtype)
    return token_rewards - coef * kl
