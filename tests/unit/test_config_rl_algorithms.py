"""Config rules of rloo / reinforce_plus_plus / dapo / GSPO: each refused setting names its key."""

from __future__ import annotations

from tests.unit.test_config import problems_of, with_keys
from trinity.config.loader import load_config


def rl(small_job, name, **keys):
    return with_keys(small_job, algorithm__name=name, data__train_batch_size=8,
                     actor_rollout_ref__actor__ppo_mini_batch_size=8, **keys)


def test_rloo_and_dapo_need_a_group(write_job, small_job):
    for name, label in (("rloo", "RLOO"), ("dapo", "DAPO")):
        probs = problems_of(write_job(rl(small_job, name, actor_rollout_ref__rollout__n=1)))
        assert f"actor_rollout_ref.rollout.n: {label} compares responses within a group; use n >= 2" in probs
    # a global baseline needs no group
    assert load_config(write_job(rl(small_job, "reinforce_plus_plus", actor_rollout_ref__rollout__n=1))).config.actor_rollout_ref.rollout.n == 1


def test_reinforce_plus_plus_puts_kl_in_the_reward_unless_told_not_to(write_job, small_job):
    cfg = load_config(write_job(rl(small_job, "reinforce_plus_plus"))).config
    assert cfg.algorithm.use_kl_in_reward and "actor_rollout_ref.ref" in cfg.roles()
    cfg = load_config(write_job(rl(small_job, "reinforce_plus_plus", algorithm__use_kl_in_reward=False))).config
    assert not cfg.algorithm.use_kl_in_reward and list(cfg.roles()) == ["actor_rollout_ref.actor"]


def test_dapo_options_only_with_dapo(write_job, small_job):
    job = rl(small_job, "grpo", algorithm__filter_groups={"enable": True},
             reward_model={"overlong_buffer": {"enable": True, "len": 16}})
    probs = problems_of(write_job(job))
    assert "algorithm.filter_groups.enable: dynamic sampling is part of the dapo recipe, not grpo; set algorithm.name: dapo or remove the key" in probs
    assert "reward_model.overlong_buffer.enable: overlong reward shaping is part of the dapo recipe, not grpo; set algorithm.name: dapo or remove the key" in probs
    ok = load_config(write_job(with_keys(job, algorithm__name="dapo"))).config
    assert ok.algorithm.filter_groups.enable and ok.algorithm.filter_groups.metric == "seq_reward"
    assert ok.algorithm.filter_groups.max_num_gen_batches == 10 and ok.reward_model.overlong_buffer.len == 16


def test_overlong_buffer_len_within_the_response(write_job, small_job):
    for length in (0, 128):
        job = rl(small_job, "dapo", reward_model={"overlong_buffer": {"enable": True, "len": length}},
                 actor_rollout_ref__rollout__response_length=128)
        assert f"reward_model.overlong_buffer.len: {length} must be between 1 and actor_rollout_ref.rollout.response_length - 1 (127): the penalty starts response_length - len tokens in" in problems_of(write_job(job))


def test_filter_metric_and_loss_mode_are_validated_fields(write_job, small_job):
    probs = problems_of(write_job(rl(small_job, "dapo", algorithm__filter_groups={"metric": "acc"})))
    assert any(p.startswith("algorithm.filter_groups.metric:") for p in probs), probs
    probs = problems_of(write_job(rl(small_job, "grpo", actor_rollout_ref__actor__policy_loss={"loss_mode": "gpg"})))
    assert any(p.startswith("actor_rollout_ref.actor.policy_loss.loss_mode:") for p in probs), probs
    probs = problems_of(write_job(with_keys(small_job, actor_rollout_ref__actor__policy_loss={"loss_mode": "gspo"})))
    assert "actor_rollout_ref.actor.policy_loss.loss_mode: a policy loss applies to RL algorithms, not sft; remove the key" in probs


def test_gspo_defaults_follow_verl_examples_and_explicit_values_stand(write_job, small_job):
    cfg = load_config(write_job(rl(small_job, "grpo", actor_rollout_ref__actor__policy_loss={"loss_mode": "gspo"}))).config
    a = cfg.actor_rollout_ref.actor
    assert (a.clip_ratio_low, a.clip_ratio_high, a.loss_agg_mode.value) == (3e-4, 4e-4, "seq-mean-token-mean")
    path = write_job(rl(small_job, "grpo", actor_rollout_ref__actor__policy_loss={"loss_mode": "gspo"}))
    a = load_config(path, ["actor_rollout_ref.actor.clip_ratio_low=0.001"]).config.actor_rollout_ref.actor
    assert a.clip_ratio_low == 0.001 and a.clip_ratio_high == 4e-4
