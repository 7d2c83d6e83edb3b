"""KL estimators on given log-probs, and the KL reward penalty."""

from __future__ import annotations

import math

import pytest
import torch

from trinity.algorithms.kl import apply_kl_penalty, kl_estimator, token_kl
from trinity.config.schema import KLEstimator

LOGP = torch.tensor([-1.0, -2.0])
REF = torch.tensor([-1.5, -1.0])


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("kl", [0.5, -1.0]),
        ("k1", [0.5, -1.0]),
        ("abs", [0.5, 1.0]),
        ("mse", [0.125, 0.5]),
        ("k2", [0.125, 0.5]),
        # r = ref - logp = [-0.5, 1]: exp(r) - r - 1
        ("low_var_kl", [math.exp(-0.5) - 0.5, math.e - 2.0]),
        ("k3", [math.exp(-0.5) - 0.5, math.e - 2.0]),
        (KLEstimator.low_var_kl, [math.exp(-0.5) - 0.5, math.e - 2.0]),
    ],
)
def test_estimators(kind, expected):
    torch.testing.assert_close(token_kl(LOGP, REF, kind), torch.tensor(expected))


def test_low_var_kl_is_clamped():
    # r = -30 -> clamped to -20: exp(-20) + 19 -> 10; r = +30 -> 20: exp(20) - 21 -> 10
    out = token_kl(torch.tensor([0.0, -30.0]), torch.tensor([-30.0, 0.0]), "low_var_kl")
    torch.testing.assert_close(out, torch.tensor([10.0, 10.0]))
    assert torch.isfinite(out).all()


def test_unknown_estimator_names_the_choices():
    with pytest.raises(ValueError, match="'k4'.*low_var_kl"):
        kl_estimator("k4")


def test_apply_kl_penalty():
    rewards = torch.tensor([0.0, 1.0])
    torch.testing.assert_close(apply_kl_penalty(rewards, LOGP, REF, 0.1, "kl"), torch.tensor([-0.05, 1.1]))
    masked = apply_kl_penalty(rewards, LOGP, REF, 0.1, KLEstimator.kl, response_mask=torch.tensor([1, 0]))
    torch.testing.assert_close(masked, torch.tensor([-0.05, 1.0]))


def test_apply_kl_penalty_carries_no_gradient():
    logp = LOGP.clone().requires_grad_(True)
    out = apply_kl_penalty(torch.zeros(2), logp, REF, 0.1, "mse")
    assert not out.requires_grad
