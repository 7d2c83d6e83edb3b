"""LoRA's pure logic: target names, adapter sizes per TP rank, config errors naming the key, the
`trinity validate` plan."""

from __future__ import annotations

import pytest

from tests.conftest import HF_CONFIGS
from trinity.models.facts import ModelFacts
from trinity.models.lora_targets import (
    HF_TO_MCORE,
    adapter_parameter_count,
    adapter_parameters_per_gpu,
    linear_shape,
    resolve_targets,
)


def test_hf_names_map_to_the_fused_megatron_linears():
    assert resolve_targets(["q_proj", "v_proj"]) == ["linear_qkv"]
    assert resolve_targets(["down_proj", "o_proj", "gate_proj", "up_proj"]) == ["linear_proj", "linear_fc1", "linear_fc2"]
    assert resolve_targets(["all-linear"]) == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    assert resolve_targets(["linear_fc2", "linear_qkv"]) == ["linear_qkv", "linear_fc2"]
    assert HF_TO_MCORE["k_proj"] == "linear_qkv" and HF_TO_MCORE["down_proj"] == "linear_fc2"
    with pytest.raises(ValueError, match=r"unknown target module\(s\) \['lm_head'\]; valid: linear_qkv, linear_proj"):
        resolve_targets(["q_proj", "lm_head"])


def test_adapter_sizes_per_tp_rank():
    facts = ModelFacts.from_hf_dir(HF_CONFIGS / "qwen2_5_7b")  # h 3584, 28 heads, 4 kv heads, ffn 18944
    assert linear_shape(facts, "linear_qkv") == (3584, 3584 + 2 * 512)
    assert linear_shape(facts, "linear_fc1") == (3584, 2 * 18944)
    # r x (in + out) per linear: one A for q, k and v (and for gate and up), unlike PEFT's per-projection A
    per_layer = 16 * ((3584 + 4608) + (3584 + 3584) + (3584 + 37888) + (18944 + 3584))
    assert adapter_parameter_count(facts, 16, ["all-linear"]) == 28 * per_layer
    # TP=2: column-parallel (qkv, fc1) split B's rows, row-parallel (proj, fc2) split A's columns
    tp2 = 16 * ((3584 + 4608 // 2) + (3584 // 2 + 3584) + (3584 + 37888 // 2) + (18944 // 2 + 3584))
    assert adapter_parameters_per_gpu(facts, 16, ["all-linear"], tp=2, layers=1) == tp2


def _problems(small_job, lora: dict, **extra) -> list[str]:
    from trinity.config.rules import check_job
    from trinity.config.schema import JobConfig

    job = {**small_job, **extra}
    job["actor_rollout_ref"] = {"actor": {"lora": lora}}
    _, problems, _ = check_job(JobConfig.model_validate(job), check_paths=False)
    return [p for p in problems if "lora" in p]


def test_config_errors_name_the_key(small_job):
    assert _problems(small_job, {"rank": 8}) == []
    assert _problems(small_job, {"rank": 8, "target_modules": ["q_proj", "lm_head"]}) == [
        "actor_rollout_ref.actor.lora.target_modules: unknown target module(s) ['lm_head']; valid: linear_qkv, "
        "linear_proj, linear_fc1, linear_fc2, linear_q_down_proj, linear_q_up_proj, linear_kv_down_proj, "
        "linear_kv_up_proj, q_proj, k_proj, v_proj, qkv_proj, o_proj, gate_proj, up_proj, "
        "gate_up_proj, down_proj, q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, all-linear"
    ]
    assert _problems(small_job, {"alpha": 32.0, "target_modules": ["q_proj"]}) == [
        "actor_rollout_ref.actor.lora.alpha: has no effect while actor_rollout_ref.actor.lora.rank is 0 (LoRA off); "
        "set rank >= 1 or remove the key",
        "actor_rollout_ref.actor.lora.target_modules: has no effect while actor_rollout_ref.actor.lora.rank is 0 "
        "(LoRA off); set rank >= 1 or remove the key",
    ]
    assert _problems(small_job, {"rank": 8, "target_modules": []}) == [
        "actor_rollout_ref.actor.lora.target_modules: is empty; name at least one linear (e.g. all-linear)"
    ]
    moe = _problems(small_job, {"rank": 8}, model={"path": str(HF_CONFIGS / "qwen3_30b_a3b")})
    assert moe == [
        "actor_rollout_ref.actor.lora.target_modules: linear_fc1, linear_fc2 of an MoE model are its experts, which "
        "LoRA does not adapt; target linear_qkv and linear_proj only"
    ]


@pytest.mark.parametrize("bad", [{"rank": -1}, {"rank": 4, "alpha": 0}, {"rank": 4, "dropout": 1.0}])
def test_out_of_range_values_name_the_key(small_job, bad):
    from pydantic import ValidationError

    from trinity.config.schema import JobConfig

    job = {**small_job, "actor_rollout_ref": {"actor": {"lora": bad}}}
    with pytest.raises(ValidationError) as info:
        JobConfig.model_validate(job)
    (err,) = info.value.errors()
    field = next(k for k in bad if k != "rank" or len(bad) == 1)
    assert err["loc"] == ("actor_rollout_ref", "actor", "lora", field)


def test_plan_shows_trainable_parameters_and_memory_saved(small_job):
    from trinity.config.plan import build_plan, render_plan
    from trinity.config.rules import check_job
    from trinity.config.schema import JobConfig

    def plan(lora):
        job = {**small_job, "actor_rollout_ref": {"actor": {"lora": lora}}}
        cfg = JobConfig.model_validate(job)
        facts, problems, warnings = check_job(cfg, check_paths=False)
        assert problems == []
        return build_plan(cfg, facts, warnings)

    full, adapted = plan({}), plan({"rank": 8})
    f, a = full.roles[0].memory, adapted.roles[0].memory
    facts = ModelFacts.from_hf_dir(HF_CONFIGS / "qwen2_5_0_5b")
    n = adapter_parameter_count(facts, 8, ["all-linear"])
    assert adapted.trainable_parameters == n and full.trainable_parameters is None
    assert a.trainable_per_gpu == n  # TP=1 in small_job
    dp = adapted.roles[0].dp  # 8 GPUs, the distributed optimizer (default) shards the adapters' state over DP
    assert a.grads == 4 * n and a.optimizer == 12 * n // dp  # bf16 on cuda: fp32 master + Adam m, v
    assert a.weights == f.weights + 2 * n
    assert a.lora_saved == f.grads + f.optimizer - a.grads - a.optimizer > 0
    text = render_plan(adapted)
    assert f"LoRA: {n:,} trainable adapter parameters" in text
    assert "less than full fine-tuning" in text


def test_resume_refuses_a_checkpoint_of_the_other_kind(tmp_path):
    """A LoRA checkpoint (adapters only) cannot resume a full fine-tune, nor another rank; a full one
    cannot resume a LoRA job: refused naming the setting before anything is loaded."""
    import json
    from types import SimpleNamespace

    from trinity.convert.dist_ckpt import FORMAT, META
    from trinity.errors import UserError
    from trinity.trainer.engine.engine import RoleEngine

    def ckpt(name, lora):
        path = tmp_path / name
        path.mkdir()
        (path / META).write_text(json.dumps({"format": FORMAT, **({"lora": lora} if lora else {})}))
        return path

    adapters, full = ckpt("adapters", {"rank": 8, "alpha": 16.0}), ckpt("full", None)
    check = RoleEngine._check_lora_matches
    check(SimpleNamespace(lora=SimpleNamespace(rank=8)), adapters)
    check(SimpleNamespace(lora=None), full)
    with pytest.raises(UserError, match=r"holds LoRA adapters only \(rank 8\), but actor_rollout_ref.actor.lora is off"):
        check(SimpleNamespace(lora=None), adapters)
    with pytest.raises(UserError, match="is a full-model checkpoint, but actor_rollout_ref.actor.lora is on"):
        check(SimpleNamespace(lora=SimpleNamespace(rank=8)), full)
    with pytest.raises(UserError, match=r"^actor_rollout_ref.actor.lora.rank: 4 differs from the checkpoint's 8"):
        check(SimpleNamespace(lora=SimpleNamespace(rank=4)), adapters)
