"""PPO-clip (both clip sides, dual clip), value clipping, aggregation modes, micro-batch normalisation."""

from __future__ import annotations

import math

import pytest
import torch

from trinity.algorithms.losses import (
    agg_denominator,
    agg_loss,
    entropy_loss,
    global_agg_denominator,
    kl_loss,
    ppo_policy_loss,
    value_loss,
)
from trinity.config.schema import LossAggMode

# Tokens (ratio, advantage), clip_ratio_low 0.2, clip_ratio_high 0.3, clip_ratio_c 3:
#  1.5, +1: max(-1.5, -1.3) = -1.3  upper clip active
#  0.5, +1: max(-0.5, -0.8) = -0.5
#  0.5, -1: max( 0.5,  0.8) =  0.8  lower clip active
#  5.0, -1: max( 5.0,  1.3) =  5.0  -> dual clip min(5, 3) = 3
#  1.1, -2: 2.2 (inside the range)
#  3.0, +1: masked out
RATIO = torch.tensor([[1.5, 0.5, 0.5], [5.0, 1.1, 3.0]])
ADV = torch.tensor([[1.0, 1.0, -1.0], [-1.0, -2.0, 1.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def _policy(clip_ratio_c):
    logp = RATIO.log().requires_grad_(True)
    loss, metrics = ppo_policy_loss(
        torch.zeros(2, 3), logp, ADV, MASK, clip_ratio_low=0.2, clip_ratio_high=0.3, clip_ratio_c=clip_ratio_c
    )
    loss.backward()
    return loss, metrics, logp.grad


def test_ppo_clip_with_dual_clip():
    loss, metrics, grad = _policy(3.0)
    assert loss.item() == pytest.approx((-1.3 - 0.5 + 0.8 + 3.0 + 2.2) / 5, abs=1e-6)
    assert metrics.pg_clipfrac.item() == pytest.approx(2 / 5)
    assert metrics.pg_clipfrac_lower.item() == pytest.approx(1 / 5)
    log_ratios = [math.log(r) for r in (1.5, 0.5, 0.5, 5.0, 1.1)]
    assert metrics.ppo_kl.item() == pytest.approx(-sum(log_ratios) / 5, abs=1e-6)
    # d(-A r)/d logp = -A r on unclipped tokens, 0 on clipped/capped/masked ones; token-mean divides by 5
    expected = torch.tensor([[0.0, -0.5 / 5, 0.0], [0.0, 2.2 / 5, 0.0]])
    torch.testing.assert_close(grad, expected)


def test_ppo_clip_without_dual_clip():
    loss, metrics, grad = _policy(None)
    assert loss.item() == pytest.approx((-1.3 - 0.5 + 0.8 + 5.0 + 2.2) / 5, abs=1e-6)
    assert metrics.pg_clipfrac_lower.item() == 0.0
    assert grad[1, 0].item() == pytest.approx(5.0 / 5)


def test_dual_clip_bound_must_exceed_one():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ppo_policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), clip_ratio_c=0.5)


LOSS_MAT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
AGG_MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # the last row has no tokens


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 2 + 4) / 3),
        ("seq-mean-token-sum", (3 + 4) / 2),
        ("seq-mean-token-mean", (1.5 + 4) / 2),
        (LossAggMode.seq_mean_token_mean, (1.5 + 4) / 2),
    ],
)
def test_agg_modes(mode, expected):
    assert agg_loss(LOSS_MAT, AGG_MASK, mode).item() == pytest.approx(expected)


def test_agg_unknown_mode():
    with pytest.raises(ValueError):
        agg_loss(LOSS_MAT, AGG_MASK, "token-sum")


@pytest.mark.parametrize("mode", list(LossAggMode))
def test_micro_batches_with_global_denominator_equal_full_batch(mode):
    torch.manual_seed(0)
    weights = torch.randn(6, 5, requires_grad=True)
    mask = torch.tensor(
        [[1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]]
    )
    full = agg_loss(weights.square(), mask, mode)
    (full_grad,) = torch.autograd.grad(full, weights)

    micro = [slice(0, 1), slice(1, 4), slice(4, 6)]  # uneven token counts per micro batch
    denominator = global_agg_denominator([mask[s] for s in micro], mode)
    assert denominator.item() == agg_denominator(mask, mode).item()
    total = sum(agg_loss(weights[s].square(), mask[s], mode, denominator) for s in micro)
    (micro_grad,) = torch.autograd.grad(total, weights)
    assert total.item() == pytest.approx(full.item(), rel=1e-6)
    torch.testing.assert_close(micro_grad, full_grad)
    # the naive mean of micro means is different here: the test would catch a missing global denominator
    naive = sum(agg_loss(weights[s].square(), mask[s], mode) for s in micro) / len(micro)
    assert abs(naive.item() - full.item()) > 1e-3


def test_value_loss_clipping():
    # cliprange 0.5; (V, V_old, R):
    #  (1.0, 0, 2): clipped V 0.5 -> errors 1 vs 2.25 -> 2.25 (clip counted)
    #  (1.0, 0, 0): clipped V 0.5 -> errors 1 vs 0.25 -> 1
    #  (0.2, 0, 1): inside the range -> 0.64
    values = torch.tensor([[1.0, 1.0, 0.2, 50.0]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    returns = torch.tensor([[2.0, 0.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, metrics = value_loss(values, old, returns, mask, cliprange_value=0.5)
    assert loss.item() == pytest.approx(0.5 * (2.25 + 1.0 + 0.64) / 3)
    assert metrics.vf_clipfrac.item() == pytest.approx(1 / 3)
    loss.backward()
    # d/dV 0.5*(V-R)^2/3 = (V-R)/3 where the unclipped error is the max, 0 where the clipped one is
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 1.0 / 3, -0.8 / 3, 0.0]]))


def test_entropy_and_kl_loss():
    mask = torch.tensor([[1, 1, 0]])
    assert entropy_loss(torch.tensor([[1.0, 2.0, 9.0]]), mask).item() == pytest.approx(1.5)
    logp = torch.tensor([[-1.0, -2.0, 0.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, 0.0]], requires_grad=True)
    loss = kl_loss(logp, ref, mask, kind="kl")
    assert loss.item() == pytest.approx((0.5 - 1.0) / 2)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.5, 0.5, 0.0]]))
    assert ref.grad is None


def test_actor_loss_combines_terms():
    from trinity.algorithms.losses import actor_loss
    from trinity.config.schema import ActorConfig

    logp = torch.tensor([[0.0, 0.0]], requires_grad=True)  # ratio 1: pg loss = -mean(A) = -1.5
    advantages = torch.tensor([[1.0, 2.0]])
    mask = torch.ones(1, 2)
    entropy = torch.tensor([[0.5, 1.5]])  # mean 1
    ref = torch.tensor([[-1.0, 1.0]])  # k1 = logp - ref = [1, -1], mean 0; mse: 0.5*[1, 1], mean 0.5
    actor = ActorConfig(entropy_coeff=0.1, use_kl_loss=True, kl_loss_coef=0.2, kl_loss_type="mse")
    loss, metrics = actor_loss(logp, logp.detach(), advantages, mask, actor, entropy=entropy, ref_logp=ref)
    assert loss.item() == pytest.approx(-1.5 - 0.1 * 1.0 + 0.2 * 0.5)
    assert metrics["actor/kl_loss"].item() == pytest.approx(0.5)
    assert metrics["actor/entropy"].item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="reference log-probs"):
        actor_loss(logp, logp.detach(), advantages, mask, actor, entropy=entropy)
