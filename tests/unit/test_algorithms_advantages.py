"""GRPO and GAE advantages against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from trinity.algorithms.advantages import gae_advantages, grpo_outcome_advantages, masked_whiten


def test_grpo_two_groups_with_std():
    # group a: scores 1, 3 -> mean 2, unbiased std sqrt(2); group b: 0, 0, 3 -> mean 1, std sqrt(3)
    scores = torch.tensor([0.0, 1.0, 0.0, 3.0, 3.0])
    groups = ["b", "a", "b", "a", "b"]
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [0, 1, 1]])
    adv, returns = grpo_outcome_advantages(scores, groups, mask, norm_adv_by_std_in_grpo=True, epsilon=0.0)
    per_sample = [-1 / math.sqrt(3), -1 / math.sqrt(2), -1 / math.sqrt(3), 1 / math.sqrt(2), 2 / math.sqrt(3)]
    expected = torch.tensor(per_sample).unsqueeze(-1) * mask
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(returns, expected)


def test_grpo_without_std_and_tensor_ids():
    scores = torch.tensor([0.0, 1.0, 0.0, 3.0, 3.0])
    groups = torch.tensor([7, 2, 7, 2, 7])
    mask = torch.ones(5, 2)
    adv, _ = grpo_outcome_advantages(scores, groups, mask, norm_adv_by_std_in_grpo=False)
    expected = torch.tensor([-1.0, -1.0, -1.0, 1.0, 2.0]).unsqueeze(-1).expand(5, 2)
    torch.testing.assert_close(adv, expected)


def test_grpo_equal_scores_and_singleton_group():
    # equal scores -> 0 advantage (no NaN); a lone sample keeps its score (verl: mean 0, std 1)
    adv, _ = grpo_outcome_advantages(torch.tensor([2.0, 2.0, 0.5]), [0, 0, 1], torch.ones(3, 1))
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.0, 0.0, 0.5 / (1 + 1e-6)]))


def test_grpo_rejects_wrong_number_of_ids():
    with pytest.raises(ValueError, match="expected 3"):
        grpo_outcome_advantages(torch.zeros(3), [0, 1], torch.ones(3, 1))


def test_gae_three_tokens_by_hand():
    # gamma 0.9, lam 0.8 (gamma*lam = 0.72), V after the last counted token is 0
    # row 0: delta = [0.04, 0.03, 0.3]; A2 = 0.3, A1 = 0.03 + 0.72*0.3 = 0.246, A0 = 0.04 + 0.72*0.246
    # row 1: last token padded: A1 = 1 - 0.6 = 0.4, A0 = 0.9*0.6 - 0.5 + 0.72*0.4 = 0.328
    # row 2: hole in the middle: A2 = 0.3, A0 = 0.9*0.7 - 0.5 + 0.72*0.3 = 0.346
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 5.0], [0.0, 7.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [0.5, 0.6, 9.0], [0.5, 9.0, 0.7]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 1]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.21712, 0.246, 0.3], [0.328, 0.4, 0.0], [0.346, 0.0, 0.3]]))
    torch.testing.assert_close(ret, torch.tensor([[0.71712, 0.846, 1.0], [0.828, 1.0, 0.0], [0.846, 0.0, 1.0]]))


def test_gae_whitened_has_zero_mean_unit_var_on_mask():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 5.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [0.5, 0.6, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, _ = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8, whiten=True)
    counted = adv[mask.bool()]
    assert abs(counted.mean().item()) < 1e-6
    assert abs(counted.std().item() - 1.0) < 1e-5
    assert adv[1, 2].item() == 0.0


def test_masked_whiten_by_hand():
    values = torch.tensor([[1.0, 2.0], [3.0, 100.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    # mean 2, unbiased var ((1)+(0)+(1))/2 = 1
    torch.testing.assert_close(masked_whiten(values, mask, eps=0.0), torch.tensor([[-1.0, 0.0], [1.0, 0.0]]))
    torch.testing.assert_close(
        masked_whiten(values, mask, shift_mean=False, eps=0.0), torch.tensor([[1.0, 2.0], [3.0, 0.0]])
    )
