"""RLOO, REINFORCE++, GSPO and DAPO's pieces against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from trinity.algorithms.advantages import reinforce_plus_plus_advantages, rloo_outcome_advantages
from trinity.algorithms.dapo import overlong_penalty, varied_groups
from trinity.algorithms.kl import apply_kl_penalty
from trinity.algorithms.losses import actor_loss, gspo_policy_loss, ppo_policy_loss
from trinity.config.schema import ActorConfig, LossAggMode


def test_rloo_leave_one_out_baseline_by_hand():
    # group a: rewards 1, 2, 6 -> baselines (2+6)/2, (1+6)/2, (1+2)/2; group b: 0.5, 0 -> 0, 0.5
    scores = torch.tensor([1.0, 0.5, 2.0, 6.0, 0.0])
    ids = ["a", "b", "a", "a", "b"]
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1], [1, 1]])
    adv, ret = rloo_outcome_advantages(scores, ids, mask)
    expected = torch.tensor([-3.0, 0.5, -1.5, 4.5, -0.5])
    assert torch.allclose(adv[:, 0], expected)
    assert adv[1, 1] == 0 and torch.equal(adv, ret)
    # n / (n - 1) * (r - group mean), verl's form, is the same number
    assert math.isclose(3 / 2 * (6.0 - 3.0), 4.5)


def test_rloo_singleton_keeps_raw_score():
    adv, _ = rloo_outcome_advantages(torch.tensor([0.7, 1.0, 3.0]), [0, 1, 1], torch.ones(3, 1))
    assert torch.allclose(adv[:, 0], torch.tensor([0.7, -2.0, 2.0]))


def test_reinforce_plus_plus_returns_and_global_whitening_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = reinforce_plus_plus_advantages(rewards, mask, gamma=1.0)
    assert torch.allclose(ret, torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]))
    # masked returns 1,1,1,2,2: mean 1.4, unbiased var (3 * 0.16 + 2 * 0.36) / 4 = 0.3
    std = math.sqrt(0.3 + 1e-8)
    expected = torch.tensor([[-0.4, -0.4, -0.4], [0.6, 0.6, 0.0]]) / std
    assert torch.allclose(adv, expected, atol=1e-6)
    _, ret = reinforce_plus_plus_advantages(rewards, mask, gamma=0.5)
    assert torch.allclose(ret, torch.tensor([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]))


def test_reinforce_plus_plus_with_kl_in_reward():
    """The per-token KL penalty (k1, coef 0.5) enters every token's reward, so each return is the outcome
    minus the KL still to come."""
    scores = torch.tensor([[0.0, 0.0, 1.0]])
    logp = torch.tensor([[-1.0, -1.0, -1.0]])
    ref = logp - torch.tensor([[0.1, 0.2, 0.3]])
    rewards = apply_kl_penalty(scores, logp, ref, 0.5, "kl", torch.ones(1, 3))
    _, ret = reinforce_plus_plus_advantages(rewards, torch.ones(1, 3), gamma=1.0)
    assert torch.allclose(ret, torch.tensor([[0.7, 0.75, 0.85]]))


def test_gspo_sequence_ratio_and_clip_by_hand():
    # seq 1: log ratios 0.1, 0.3 (third token masked) -> s = exp(0.2), A = 1: clipped at 1 + 4e-4
    # seq 2: log ratios -0.1, 0, 0.1 -> s = 1, A = -2: loss 2 per token
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.1, 0.3, 5.0], [-0.1, 0.0, 0.1]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss, m = gspo_policy_loss(old, logp, adv, mask, 3e-4, 4e-4, 3.0, LossAggMode.seq_mean_token_mean)
    assert math.isclose(float(loss), (-1.0004 + 2.0) / 2, rel_tol=1e-6)
    assert math.isclose(float(m.pg_clipfrac), 2 / 5, rel_tol=1e-6)  # seq 1's two tokens
    assert math.isclose(float(m.ppo_kl), -(0.1 + 0.3 - 0.1 + 0.0 + 0.1) / 5, rel_tol=1e-5)
    assert float(m.pg_clipfrac_lower) == 0.0


def test_gspo_gradient_is_the_sequence_ratio_gradient():
    """Unclipped, the loss of a sequence is -A * exp(mean(logp - old)): its gradient per token is
    -A * s / |y| (seq-mean over 2 sequences halves it); masked tokens get none."""
    old = torch.tensor([[-1.0, -2.0, -1.0], [-0.5, -0.5, -0.5]])
    logp = torch.tensor([[-0.9, -1.7, -3.0], [-0.6, -0.5, -0.4]], requires_grad=True)
    adv = torch.tensor([[1.0] * 3, [-0.5] * 3])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss, _ = gspo_policy_loss(old, logp, adv, mask, 0.5, 0.5, None, LossAggMode.seq_mean_token_mean)
    loss.backward()
    s1 = math.exp((0.1 + 0.3) / 2)
    s2 = math.exp((-0.1 + 0.0 + 0.1) / 3)
    expected = torch.tensor([[-s1 / 2 / 2, -s1 / 2 / 2, 0.0], [0.5 * s2 / 3 / 2] * 3])
    assert torch.allclose(logp.grad, expected, atol=1e-6)
    # the same value as the direct sequence-level objective
    direct = (-1.0 * s1 + 0.5 * s2) / 2
    assert math.isclose(float(loss), direct, rel_tol=1e-6)


def test_gspo_differs_from_token_ratios():
    """Token ratios 1.5 and 0.5 (geometric mean ~0.866): PPO clips each token, GSPO the sequence."""
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[1.5, 0.5]]))
    adv = torch.ones(1, 2)
    mask = torch.ones(1, 2)
    ppo, _ = ppo_policy_loss(old, logp, adv, mask, 0.2, 0.2, None, LossAggMode.token_mean)
    gspo, _ = gspo_policy_loss(old, logp, adv, mask, 0.2, 0.2, None, LossAggMode.token_mean)
    assert math.isclose(float(ppo), -(1.2 + 0.5) / 2, rel_tol=1e-6)
    assert math.isclose(float(gspo), -math.sqrt(0.75), rel_tol=1e-6)


def test_policy_loss_mode_selects_gspo_with_its_defaults():
    actor = ActorConfig.model_validate({"policy_loss": {"loss_mode": "gspo"}})
    assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.loss_agg_mode) == (3e-4, 4e-4, LossAggMode.seq_mean_token_mean)
    explicit = ActorConfig.model_validate({"policy_loss": {"loss_mode": "gspo"}, "clip_ratio_high": 0.01, "loss_agg_mode": "token-mean"})
    assert (explicit.clip_ratio_low, explicit.clip_ratio_high, explicit.loss_agg_mode) == (3e-4, 0.01, LossAggMode.token_mean)
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.1, 0.3, 5.0], [-0.1, 0.0, 0.1]])
    adv = torch.tensor([[1.0] * 3, [-2.0] * 3])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss, metrics = actor_loss(logp, old, adv, mask, actor)
    direct, _ = gspo_policy_loss(old, logp, adv, mask, 3e-4, 4e-4, 3.0, LossAggMode.seq_mean_token_mean)
    assert torch.equal(loss, direct) and torch.equal(metrics["actor/pg_loss"], direct)
    vanilla, _ = actor_loss(logp, old, adv, mask, ActorConfig())
    assert not torch.allclose(vanilla, direct)


def test_cispo_loss_gradient_and_clip_fraction_by_hand():
    """CISPO: -sg(clip(r, 0.8, 1.28)) * A * logp per token, token-mean over the 5 unmasked tokens."""
    from trinity.algorithms.cispo import cispo_policy_loss

    r = torch.tensor([[1.5, 0.5, 1.1], [1.0, 1.0, 3.0]])
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]], requires_grad=True)
    old = logp.detach() - torch.log(r)
    adv = torch.tensor([[2.0, -1.0, 0.5], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, m = cispo_policy_loss(old, logp, adv, mask, 0.2, 0.28, None, LossAggMode.token_mean)
    # weights 1.28 (clipped from 1.5), 0.8 (clipped from 0.5), 1.1, 1, 1 (the masked token does not count)
    # token losses -w A logp: 2.56, -1.6, 0.275, 0.3, 0.7
    assert math.isclose(float(loss), (2.56 - 1.6 + 0.275 + 0.3 + 0.7) / 5, rel_tol=1e-6)
    loss.backward()
    # d loss / d logp = -w A / 5: the token clipped at 1.28 keeps its gradient (PPO-clip drops it)
    expected = torch.tensor([[-2.56, 0.8, -0.55], [-1.0, -1.0, 0.0]]) / 5
    assert torch.allclose(logp.grad, expected, atol=1e-6)
    assert math.isclose(float(m.pg_clipfrac), 2 / 5, rel_tol=1e-6) and float(m.pg_clipfrac_lower) == 0.0
    assert math.isclose(float(m.ppo_kl), -(math.log(1.5) + math.log(0.5) + math.log(1.1)) / 5, rel_tol=1e-5)
    ppo_logp = logp.detach().clone().requires_grad_(True)
    ppo, _ = ppo_policy_loss(old, ppo_logp, adv, mask, 0.2, 0.28, None, LossAggMode.token_mean)
    ppo.backward()
    assert ppo_logp.grad[0, 0] == 0 and ppo_logp.grad[0, 1] == 0  # outside the clip range: no gradient


def test_cispo_is_the_algorithms_own_loss(write_job, small_job):
    """algorithm.name: cispo runs the RL recipe with GRPO's advantages and its own loss (the spec's)."""
    from tests.unit.test_config import problems_of, with_keys
    from trinity.algorithms.advantages import ESTIMATORS
    from trinity.algorithms.cispo import cispo_policy_loss
    from trinity.config.loader import load_config

    job = with_keys(small_job, algorithm__name="cispo", data__train_batch_size=8,
                    actor_rollout_ref__actor__ppo_mini_batch_size=8)
    cfg = load_config(write_job(job)).config
    assert cfg.spec.load_policy_loss() is cispo_policy_loss and cfg.spec.load_recipe().__name__ == "RLRecipe"
    assert ESTIMATORS[cfg.spec.advantages] is ESTIMATORS["grpo"] and list(cfg.roles()) == ["actor_rollout_ref.actor"]
    old, logp = torch.zeros(1, 2), torch.tensor([[-0.5, -1.5]])
    loss, _ = actor_loss(logp, old, torch.ones(1, 2), torch.ones(1, 2), cfg.actor_rollout_ref.actor,
                         policy_loss=cfg.spec.load_policy_loss())
    # ratios exp(-0.5), exp(-1.5) clipped up to 0.8: -(0.8 x -0.5 + 0.8 x -1.5) / 2
    assert math.isclose(float(loss), 0.8, rel_tol=1e-6)
    probs = problems_of(write_job(with_keys(job, actor_rollout_ref__rollout__n=1,
                                            actor_rollout_ref__actor__clip_ratio_c=2.0,
                                            actor_rollout_ref__actor__policy_loss={"loss_mode": "gspo"})))
    assert "actor_rollout_ref.rollout.n: CISPO compares responses within a group; use n >= 2" in probs
    assert "actor_rollout_ref.actor.policy_loss.loss_mode: cispo has its own policy loss (CISPO), which gspo would " \
           "replace; remove the key, or use grpo with loss_mode gspo" in probs
    assert any(p.startswith("actor_rollout_ref.actor.clip_ratio_c: 2.0 has no effect with cispo") for p in probs), probs


def test_overlong_penalty_by_hand():
    # max 20 tokens, buffer 8: free up to 12, then -1/8 per token, -1 at 20
    got = overlong_penalty(torch.tensor([10, 12, 14, 16, 20]), 20, 8, 1.0)
    assert torch.allclose(got, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0]))
    assert torch.allclose(overlong_penalty(torch.tensor([18]), 20, 4, 0.5), torch.tensor([-0.25]))
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(torch.tensor([1]), 20, 0, 1.0)


def test_varied_groups():
    keep = varied_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.0, 0.0]), 2)
    assert keep.tolist() == [False, True, False, False]
    assert varied_groups(torch.tensor([0.3, 0.3]), 1).tolist() == [True, True]
    with pytest.raises(ValueError, match="groups of 2"):
        varied_groups(torch.ones(3), 2)


def test_concat_rollouts_pads_prompts_left_and_responses_right():
    from trinity.rollout.types import Rollout
    from trinity.trainer.recipes.dapo import concat_rollouts

    a = Rollout(torch.tensor([[5, 6, 7, 8]]), torch.tensor([[1, 1]]), torch.tensor([[1, 1]]), torch.tensor([[-0.1, -0.2]]))
    b = Rollout(torch.tensor([[9, 1, 2, 3, 4]]), torch.tensor([[1]]), torch.tensor([[1, 1, 0, 0]]),
                torch.tensor([[-0.3, -0.4, 0.0, 0.0]]))
    ro = concat_rollouts([a, b], pad_id=0)
    assert ro.tokens.tolist() == [[5, 6, 7, 8, 0, 0], [0, 9, 1, 2, 3, 4]]
    assert ro.prompt_mask.tolist() == [[1, 1], [0, 1]]
    assert ro.response_mask.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0]]
    assert torch.allclose(ro.logprobs, torch.tensor([[-0.1, -0.2, 0.0, 0.0], [-0.3, -0.4, 0.0, 0.0]]))


def _dapo_recipe(monkeypatch, draws: list[list[float]], lengths: list[list[int]], **algorithm):
    """A DAPORecipe whose rollout returns responses of the given lengths and whose reward returns the given
    scores, one list per draw (the real sampling loop, filter, overlong shaping and concatenation run)."""
    from trinity.config.schema import JobConfig
    from trinity.rollout.types import Rollout
    from trinity.trainer.recipes import dapo
    from trinity.trainer.recipes.rl import Phases, Scored

    monkeypatch.setattr(dapo, "_dp_info", lambda: (0, 1, None))
    cfg = JobConfig.model_validate({
        "model": {"path": "unused"}, "algorithm": {"name": "dapo", **algorithm},
        "data": {"train_batch_size": 2}, "reward_model": {"overlong_buffer": {"enable": True, "len": 2}},
        "actor_rollout_ref": {"rollout": {"n": 2, "response_length": 4}},
    })
    scripted = iter(zip(draws, lengths))

    class Recipe(dapo.DAPORecipe):
        def generate(self, prompts, gen):
            self.current = next(scripted)
            lens = torch.tensor(self.current[1])
            mask = (torch.arange(int(lens.max()))[None, :] < lens[:, None]).long()
            tokens = torch.cat([torch.full((len(lens), 1), 7), mask * 3], dim=1)
            return self.phases.run("rollout", {}, lambda: Rollout(tokens, torch.ones(len(lens), 1, dtype=torch.long), mask, -mask.float()))

        def score(self, prompts, ro):
            return self.phases.run("reward", {}, lambda: Scored(torch.tensor(self.current[0])))

    recipe = Recipe.__new__(Recipe)
    recipe.cfg, recipe.pad_id = cfg, 0
    recipe.data = type("Data", (), {"next_batch": lambda self: ["p", "q"]})()
    recipe.phases = Phases(torch.device("cpu"), {})
    return recipe


def test_dapo_draws_until_enough_varied_groups(monkeypatch):
    # draw 1: groups (1, 1) equal, (0, 1) varied; draw 2: (0, 0) equal, (1, 0.5) varied -> batch full
    recipe = _dapo_recipe(monkeypatch, [[1, 1, 0, 1], [0, 0, 1, 0.5]], [[1, 1, 2, 1], [1, 1, 3, 4]],
                          filter_groups={"enable": True, "metric": "score"})
    s = recipe.sample(1, torch.Generator())
    ro, scores, groups, m = s.rollout, s.scores, s.groups, s.metrics
    # overlong: free up to 2 tokens, -0.5 per token after: lengths 2, 1, 3, 4 -> 0, 0, -0.5, -1
    assert torch.allclose(scores, torch.tensor([0.0, 1.0, 0.5, -0.5]))
    assert ro.response_mask.sum(-1).tolist() == [2, 1, 3, 4] and ro.tokens.shape == (4, 5)
    assert groups == [0, 0, 1, 1]
    assert m["dapo/num_gen_batches"] == 2 and m["dapo/kept_groups"] == 2 and m["dapo/filled_groups"] == 0
    assert math.isclose(m["dapo/score_mean"], 0.625) and math.isclose(m["dapo/overlong_penalty_mean"], -0.375)


def test_dapo_fills_with_dropped_groups_at_max_num_gen_batches(monkeypatch):
    recipe = _dapo_recipe(monkeypatch, [[1, 1, 0, 1], [0, 0, 1, 1]], [[1, 1, 1, 1], [1, 1, 1, 1]],
                          filter_groups={"enable": True, "metric": "score", "max_num_gen_batches": 2})
    s = recipe.sample(1, torch.Generator())
    scores, m = s.scores, s.metrics
    assert scores.tolist() == [0.0, 1.0, 1.0, 1.0]  # the varied group, then the first dropped one
    assert (m["dapo/num_gen_batches"], m["dapo/kept_groups"], m["dapo/filled_groups"]) == (2, 1, 1)


def test_dapo_seq_reward_metric_sees_the_overlong_penalty(monkeypatch):
    # equal scores, different lengths: seq_reward (score + penalty) varies, score does not
    draws, lengths = [[1, 1, 1, 1]], [[1, 4, 1, 1]]
    recipe = _dapo_recipe(monkeypatch, draws, lengths, filter_groups={"enable": True, "max_num_gen_batches": 1})
    m = recipe.sample(1, torch.Generator()).metrics
    assert (m["dapo/kept_groups"], m["dapo/filled_groups"]) == (1, 1)
