"""RLOO, REINFORCE++, GSPO, DAPO and CISPO end to end on CPU: a few steps of `trinity run` each on the tiny
random Qwen2 of test_rl_cpu.py (2 layers, hidden 64), checking what each algorithm adds to metrics.jsonl."""

from __future__ import annotations

import math

import pytest
import yaml

from tests.integration.test_rl_cpu import assets, job, rows, run_job  # noqa: F401 (assets is a fixture)


def tiny(assets, out, algo: str, steps: int = 2, kl_loss: bool = False, **extra) -> dict:
    cfg = job(assets, out, algo, steps, **extra)
    cfg["trainer"].update(save_interval=None, keep_last=1)
    cfg["actor_rollout_ref"]["actor"]["use_kl_loss"] = kl_loss
    if not kl_loss and algo != "reinforce_plus_plus":  # no ref role: its offload flag would be refused
        del cfg["actor_rollout_ref"]["ref"]
    return cfg


@pytest.mark.slow  # a torchrun job: ~25 s alone on 2 cores, minutes when they are shared
def test_rloo(assets, tmp_path):
    out = tmp_path / "rloo"
    run_job(tiny(assets, out, "rloo", kl_loss=True), tmp_path / "rloo.yaml")
    for r in rows(out):
        assert isinstance(r["actor/pg_loss"], float) and "critic/vf_loss" not in r
        # n = 2: the advantages of a group are +-(r_1 - r_2), so their extreme values mirror each other
        assert math.isclose(r["advantages/max"], -r["advantages/min"], abs_tol=1e-6)


@pytest.mark.slow  # a torchrun job: ~25 s alone on 2 cores, minutes when they are shared
def test_reinforce_plus_plus_has_kl_in_reward_and_whitened_advantages(assets, tmp_path):
    out = tmp_path / "rpp"
    cfg = tiny(assets, out, "reinforce_plus_plus")
    del cfg["algorithm"]["use_kl_in_reward"]  # unset: on by default for reinforce_plus_plus
    run_job(cfg, tmp_path / "rpp.yaml")
    for r in rows(out):
        assert "reward/with_kl_penalty_mean" in r and "actor/ref_kl" in r  # use_kl_in_reward on by default
        assert abs(r["advantages/mean"]) < 1e-5  # whitened over the whole batch


@pytest.mark.slow  # a torchrun job: ~25 s alone on 2 cores, minutes when they are shared
def test_gspo_policy_loss(assets, tmp_path):
    out = tmp_path / "gspo"
    cfg = tiny(assets, out, "grpo")
    cfg["actor_rollout_ref"]["actor"]["policy_loss"] = {"loss_mode": "gspo"}
    cfg["actor_rollout_ref"]["actor"]["ppo_epochs"] = 2  # the second pass is off-policy: the clip can act
    run_job(cfg, tmp_path / "gspo.yaml")
    for r in rows(out):
        assert isinstance(r["actor/pg_loss"], float) and 0.0 <= r["actor/pg_clipfrac"] <= 1.0
    actor = yaml.safe_load((out / "resolved_config.yaml").read_text())["actor_rollout_ref"]["actor"]
    assert (actor["clip_ratio_low"], actor["clip_ratio_high"], actor["loss_agg_mode"]) == (3e-4, 4e-4, "seq-mean-token-mean")


@pytest.mark.slow  # a torchrun job: ~25 s alone on 2 cores, minutes when they are shared
def test_cispo_clips_the_weight(assets, tmp_path):
    out = tmp_path / "cispo"
    cfg = tiny(assets, out, "cispo", steps=1)
    # the second pass is off-policy, and with ranges this narrow nearly every token's weight is clipped there
    cfg["actor_rollout_ref"]["actor"].update(ppo_epochs=2, clip_ratio_low=1e-4, clip_ratio_high=1e-4)
    run_job(cfg, tmp_path / "cispo.yaml")
    (r,) = rows(out)
    assert math.isfinite(r["actor/pg_loss"]) and r["actor/grad_norm"] > 0
    assert 0.0 < r["actor/pg_clipfrac"] <= 1.0 and r["actor/pg_clipfrac_lower"] == 0.0  # CISPO has no dual clip


@pytest.mark.slow  # a torchrun job: ~25 s alone on 2 cores, minutes when they are shared
def test_dapo_dynamic_sampling_and_overlong(assets, tmp_path):
    out = tmp_path / "dapo"
    cfg = tiny(assets, out, "dapo", algorithm={"name": "dapo", "filter_groups": {"enable": True, "max_num_gen_batches": 3}})
    cfg["reward_model"] = {"overlong_buffer": {"enable": True, "len": 3, "penalty_factor": 1.0}}
    cfg["actor_rollout_ref"]["actor"]["clip_ratio_high"] = 0.28
    run_job(cfg, tmp_path / "dapo.yaml")
    for r in rows(out):
        assert r["dapo/kept_groups"] + r["dapo/filled_groups"] == 4  # data.train_batch_size
        assert 1 <= r["dapo/num_gen_batches"] <= 3
        assert r["dapo/filled_groups"] == 0 or r["dapo/num_gen_batches"] == 3
        assert r["dapo/overlong_penalty_mean"] <= 0
        assert math.isclose(r["reward/mean"], r["dapo/score_mean"] + r["dapo/overlong_penalty_mean"], abs_tol=1e-5)
