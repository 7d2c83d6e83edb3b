"""trinity.algorithms.dpo against values computed by hand (math, not torch)."""

from __future__ import annotations

import math

import pytest
import torch

from trinity.algorithms.dpo import dpo_loss

# two pairs: policy / reference sequence log-probs of the chosen and the rejected response
CHOSEN, REJECTED = torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -1.0])
REF_C, REF_R = torch.tensor([-1.5, -2.0]), torch.tensor([-1.8, -1.5])
# h = (chosen - ref_c) - (rejected - ref_r): pair 0: 0.5 - (-0.2) = 0.7; pair 1: -1.0 - 0.5 = -1.5
H = [0.7, -1.5]


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


@pytest.mark.parametrize("ls", [0.0, 0.1])
def test_sigmoid_loss_rewards_and_accuracy(ls):
    beta = 0.1
    loss, m = dpo_loss(CHOSEN, REJECTED, REF_C, REF_R, beta=beta, label_smoothing=ls)
    want = [-(1 - ls) * _log_sigmoid(beta * h) - ls * _log_sigmoid(-beta * h) for h in H]
    assert loss.tolist() == pytest.approx(want, abs=1e-6)
    assert loss.tolist()[0] == pytest.approx(0.6588 if ls == 0 else 0.6658, abs=1e-4)  # ln 1.9324; 0.9 x that + 0.1 ln 2.0725
    assert m.chosen_reward.tolist() == pytest.approx([0.05, -0.1])
    assert m.rejected_reward.tolist() == pytest.approx([-0.02, 0.05])
    assert m.margin.tolist() == pytest.approx([0.07, -0.15])
    assert m.accuracy.tolist() == [1.0, 0.0]


def test_ipo_and_robust():
    beta = 0.5
    ipo, _ = dpo_loss(CHOSEN, REJECTED, REF_C, REF_R, beta=beta, loss_type="ipo")
    assert ipo.tolist() == pytest.approx([(0.7 - 1.0) ** 2, (-1.5 - 1.0) ** 2])  # [0.09, 6.25]
    robust, _ = dpo_loss(CHOSEN, REJECTED, REF_C, REF_R, beta=beta, loss_type="robust", label_smoothing=0.2)
    want = [(-0.8 * _log_sigmoid(beta * h) + 0.2 * _log_sigmoid(-beta * h)) / 0.6 for h in H]
    assert robust.tolist() == pytest.approx(want, abs=1e-6)


def test_gradient_raises_chosen_and_lowers_rejected():
    chosen = CHOSEN.clone().requires_grad_(True)
    rejected = REJECTED.clone().requires_grad_(True)
    loss, _ = dpo_loss(chosen, rejected, REF_C, REF_R, beta=0.1)
    loss.sum().backward()
    # d/dchosen of -log sigmoid(beta h) = -beta (1 - sigmoid(beta h)) < 0; the rejected one's is its negation
    want = [-0.1 * (1 - 1 / (1 + math.exp(-0.1 * h))) for h in H]
    assert chosen.grad.tolist() == pytest.approx(want, abs=1e-7)
    assert rejected.grad.tolist() == pytest.approx([-w for w in want], abs=1e-7)


def test_unknown_loss_type():
    with pytest.raises(ValueError, match="loss_type 'kto' is not one of"):
        dpo_loss(CHOSEN, REJECTED, REF_C, REF_R, beta=0.1, loss_type="kto")
