"""Partial rollouts' config (actor_rollout_ref.rollout.partial) and the truncated importance weights the
update applies to carried-over tokens."""

from __future__ import annotations

import math

import pytest
import torch

from tests.unit.test_config import problems_of, with_keys
from trinity.algorithms.losses import actor_loss, ppo_policy_loss, truncated_is_weights
from trinity.config.loader import load_config
from trinity.config.schema import ActorConfig

P = "actor_rollout_ref.rollout.partial"


def rl(small_job, name="grpo", **keys):
    return with_keys(small_job, algorithm__name=name, data__train_batch_size=8,
                     actor_rollout_ref__actor__ppo_mini_batch_size=8, **keys)


def test_defaults_and_a_valid_block(write_job, small_job):
    cfg = load_config(write_job(rl(small_job))).config.actor_rollout_ref.rollout.partial
    assert (cfg.enable, cfg.over_sampling_batch_size, cfg.max_staleness, cfg.rollout_is_threshold) == (False, None, 1, 2.0)
    on = {"enable": True, "over_sampling_batch_size": 16, "max_staleness": 2, "rollout_is_threshold": 5.0}
    cfg = load_config(write_job(rl(small_job, actor_rollout_ref__rollout__partial=on))).config
    assert cfg.actor_rollout_ref.rollout.partial.over_sampling_batch_size == 16


def test_what_cannot_take_effect_is_refused(write_job, small_job):
    probs = problems_of(write_job(rl(small_job, actor_rollout_ref__rollout__partial={"max_staleness": 2})))
    assert f"{P}.max_staleness: has no effect while {P}.enable is false; set enable: true or remove the key" in probs
    probs = problems_of(write_job(rl(small_job, "dapo", actor_rollout_ref__rollout__partial={"enable": True})))
    assert any(p.startswith(f"{P}.enable: not available with dapo") for p in probs), probs
    probs = problems_of(write_job(rl(small_job, actor_rollout_ref__rollout__partial={
        "enable": True, "over_sampling_batch_size": 4})))
    assert any(p.startswith(f"{P}.over_sampling_batch_size: 4 is below data.train_batch_size (8)") for p in probs), probs
    probs = problems_of(write_job(rl(small_job, actor_rollout_ref__rollout__partial={"max_staleness": 0})))
    assert any(p.startswith(f"{P}.max_staleness:") for p in probs), probs
    on = {"enable": True}
    cp = rl(small_job, actor_rollout_ref__rollout__partial=on, cluster__nproc_per_node=2,
            actor_rollout_ref__actor__megatron={"context_parallel_size": 2})
    assert any(p.startswith(f"{P}.enable: not supported with context parallelism") for p in problems_of(write_job(cp)))
    wf = rl(small_job, actor_rollout_ref__rollout__partial=on, workflow={"function": "guess_number"})
    assert any(p.startswith(f"{P}.enable: not available with a workflow") for p in problems_of(write_job(wf)))
    sft = with_keys(small_job, actor_rollout_ref__rollout__partial={"enable": True})
    assert any(p.startswith(f"{P}.enable: partial rollouts apply to RL algorithms") for p in problems_of(write_job(sft)))


def test_truncated_is_weights_by_hand():
    old = torch.tensor([[-1.0, -2.0, -0.5, 0.0]])
    behaviour = torch.tensor([[-1.0, -3.0, -0.1, -9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    w, ratio = truncated_is_weights(old, behaviour, mask, cap=2.0)
    # exp(0) = 1; exp(1) = 2.718 -> capped at 2; exp(-0.4) = 0.670; padding 0
    assert w.tolist()[0] == pytest.approx([1.0, 2.0, math.exp(-0.4), 0.0])
    assert ratio.tolist()[0][:3] == pytest.approx([1.0, math.e, math.exp(-0.4)])


def test_is_weights_multiply_each_token_policy_loss():
    """actor_loss with weights = the PPO-clip token losses times the weights, token-mean by hand."""
    g = torch.Generator().manual_seed(0)
    logp = (torch.randn(2, 5, generator=g) * 0.3 - 1).requires_grad_()
    old = logp.detach() + torch.randn(2, 5, generator=g) * 0.2
    adv = torch.randn(2, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    w = torch.tensor([[1.0, 2.0, 0.5, 0.0, 0.0], [1.5, 0.25, 0.0, 0.0, 0.0]])
    cfg = ActorConfig(entropy_coeff=0.0)
    loss, _ = actor_loss(logp, old, adv, mask, cfg, is_weights=w)
    ratio = torch.exp(logp - old)
    per = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high))
    per = torch.where(adv < 0, torch.minimum(per, -adv * cfg.clip_ratio_c), per)
    want = (per * w * mask).sum() / mask.sum()
    assert float(loss) == pytest.approx(float(want), rel=1e-6)
    plain, _ = ppo_policy_loss(old, logp, adv, mask)
    assert float(plain) != pytest.approx(float(want))  # the weights change it
