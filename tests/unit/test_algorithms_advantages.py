"""GRPO and GAE advantages against values computed by hand; PPO whitening over a DP group."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from trinity.algorithms.advantages import (
    gae_advantages, grpo_outcome_advantages, masked_mean, masked_moments, masked_var, masked_whiten,
    mean_var_from_moments,
)


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


def _batch(rows: int = 8, cols: int = 5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, cols, generator=g) * 3 + 1
    lengths = torch.randint(1, cols + 1, (rows,), generator=g)
    mask = (torch.arange(cols) < lengths[:, None]).float()
    return values, mask


SHARDS = (slice(0, 1), slice(1, 4), slice(4, 8))  # uneven DP shards, uneven token counts


def test_summed_moments_of_shards_give_the_whole_batch_mean_and_var():
    values, mask = _batch()
    moments = sum(masked_moments(values[s], mask[s]) for s in SHARDS)
    mean, var = mean_var_from_moments(moments)
    whole = values.double()
    torch.testing.assert_close(mean, masked_mean(whole, mask.double()), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(var, masked_var(whole, mask.double()), rtol=1e-12, atol=1e-12)
    assert moments[2].item() == mask.sum().item()


def _gae_rank(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        rewards, values = _batch(seed=2)[0], _batch(seed=3)[0]
        _, mask = _batch()
        rows = slice(0, 3) if rank == 0 else slice(3, 8)
        adv, ret = gae_advantages(rewards[rows], values[rows], mask[rows], 0.9, 0.8, group=dist.group.WORLD)
        whiten = [masked_whiten(values[rows], mask[rows], shift_mean=shift, group=dist.group.WORLD) for shift in (True, False)]
        alone = [dist.new_group([r]) for r in (0, 1)][rank]  # every rank makes every group
        one = (masked_whiten(values[rows], mask[rows], group=alone),
               *gae_advantages(rewards[rows], values[rows], mask[rows], 0.9, 0.8, group=alone))
        torch.save((adv, ret, whiten, one), f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
def test_gae_whitening_over_two_gloo_ranks_equals_one_rank(tmp_path):
    """Whitening over the DP group (uneven shards, uneven token counts) gives the whole batch's statistics;
    a group of one rank gives the local computation."""
    import torch.multiprocessing as mp

    mp.spawn(_gae_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    rewards, values = _batch(seed=2)[0], _batch(seed=3)[0]
    _, mask = _batch()
    adv, ret = gae_advantages(rewards, values, mask, 0.9, 0.8)
    (a0, r0, w0, one0), (a1, r1, w1, one1) = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    torch.testing.assert_close(torch.cat([a0, a1]), adv, rtol=1e-5, atol=1e-6)
    assert torch.equal(torch.cat([r0, r1]), ret)  # returns are per token: no statistics
    for i, shift in enumerate((True, False)):
        torch.testing.assert_close(torch.cat([w0[i], w1[i]]), masked_whiten(values, mask, shift_mean=shift), rtol=1e-5, atol=1e-6)
    for one, rows in ((one0, slice(0, 3)), (one1, slice(3, 8))):
        assert torch.equal(one[0], masked_whiten(values[rows], mask[rows]))
        local = gae_advantages(rewards[rows], values[rows], mask[rows], 0.9, 0.8)
        assert torch.equal(one[1], local[0]) and torch.equal(one[2], local[1])
    # per rank (no group) the shards differ from the whole batch
    assert not torch.allclose(masked_whiten(values[3:8], mask[3:8]), masked_whiten(values, mask)[3:8], atol=1e-3)
