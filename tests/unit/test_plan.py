"""The memory estimate against numbers worked by hand in docs/memory-estimate.md."""

from __future__ import annotations

import pytest

from tests.conftest import FIXTURES, HF_CONFIGS
from trinity.config.loader import load_config
from trinity.config.plan import build_plan, render_plan
from trinity.distributed.layout import ParallelLayout


def _plan(write_job, rl: bool = False, **extra):
    job = {
        "model": {"path": str(HF_CONFIGS / "qwen2_5_7b")},
        "data": {"train_files": [str(FIXTURES / "data" / "sft.jsonl")], "seq_length": 4096},
        "cluster": {"device": "cuda", "nproc_per_node": 8},
        "trainer": {"global_batch_size": 16, "micro_batch_size": 1},
        "actor_rollout_ref": {"actor": {"megatron": {"tensor_model_parallel_size": 2, "sequence_parallel": True, **extra}}},
    }
    if rl:  # offload between RL phases (SFT: optimizer_offload only, the optimizer stays on the host)
        job["algorithm"] = {"name": "grpo"}
        job["data"] = {"train_files": [str(FIXTURES / "data" / "prompts.jsonl")]}
        job["actor_rollout_ref"]["actor"]["megatron"]["sequence_parallel"] = False
    loaded = load_config(write_job(job))
    return build_plan(loaded.config, loaded.facts, loaded.warnings)


def test_qwen2_5_7b_tp2_sp_by_hand(write_job):
    plan = _plan(write_job)
    (role,) = plan.roles
    m = role.memory
    h, L, q, kv, f, V = 3584, 28, 3584, 512, 18944, 152064
    dense_layer = h * q * 2 + 2 * h * kv + 2 * h + (q + 2 * kv) + 3 * h * f
    assert dense_layer == 233_057_792
    params = L * dense_layer // 2 + V * h // 2 + h + V * h // 2
    assert m.params_per_gpu == params == 3_807_810_048
    assert m.weights == 2 * params
    assert m.grads == 4 * params
    assert m.optimizer == 12 * params // 4  # distributed over DP=4
    assert m.activations == L * 4096 * h * 34 // 2
    assert m.logits == 4096 * V // 2 * 6
    assert plan.peak_per_gpu == 43_126_563_328
    assert role.dp == 4 and role.microbatches == 4


def test_recompute_and_offload_shrink_the_estimate(write_job):
    base = _plan(write_job).roles[0].memory
    full = _plan(write_job, override_transformer_config={
        "recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}).roles[0].memory
    # full recompute keeps 28 layer inputs (2 bytes, /TP with SP) plus one layer being recomputed
    assert full.activations == 28 * 4096 * 3584 * 2 // 2 + 4096 * 3584 * 34 // 2
    sel = _plan(write_job, override_transformer_config={
        "recompute_granularity": "selective", "recompute_modules": ["mlp"]}).roles[0].memory
    assert sel.activations == 28 * 4096 * 3584 * (34 - 19) // 2
    base = _plan(write_job, rl=True).roles[0].memory
    off = _plan(write_job, rl=True, param_offload=True, grad_offload=True, optimizer_offload=True).roles[0].memory
    assert off.idle == 0 and base.idle == base.weights + base.grads + base.optimizer
    # the optimizer states come back only for the optimizer step, when activations and logits are freed
    assert base.active == base.weights + base.grads + base.optimizer + base.activations + base.logits
    assert off.active == base.weights + base.grads + max(base.optimizer, base.activations + base.logits) < base.active


@pytest.mark.parametrize(("flag", "moved"), [
    ("param_offload", "weights"), ("grad_offload", "grads"), ("optimizer_offload", "optimizer"),
])
def test_each_offload_flag_moves_its_component_to_idle(write_job, flag, moved):
    base = _plan(write_job, rl=True).roles[0].memory
    plan = _plan(write_job, rl=True, **{flag: True})
    off = plan.roles[0].memory
    assert off.offloaded == [flag]
    assert f"(offload: {flag})" in render_plan(plan)  # what `trinity validate` prints
    if flag == "optimizer_offload":  # on the device for the optimizer step only, without activations
        assert off.active == base.active - min(base.optimizer, base.activations + base.logits)
    else:  # the role brings its weights and grads back while it runs
        assert off.active == base.active
    assert off.weights == base.weights and off.grads == base.grads and off.optimizer == base.optimizer
    parts = {"weights": base.weights, "grads": base.grads, "optimizer": base.optimizer}
    assert all(v > 0 for v in parts.values())
    # idle keeps exactly the two components that are not offloaded
    assert off.idle == base.idle - parts[moved] == sum(v for k, v in parts.items() if k != moved)


def test_layout_arithmetic():
    lay = ParallelLayout(tp=2, pp=4, vpp=2, ep=4, etp=1)
    assert lay.dp(32) == 4
    assert lay.expert_dp(32) == 2
    assert lay.layers_per_chunk(48) == 6
    assert lay.num_microbatches(128, 2, 32) == 16
    assert "TP=2 PP=4 VPP=2" in lay.describe(32)


def test_sft_optimizer_offload_moves_the_optimizer_to_host_memory(write_job):
    """Qwen2.5-7B full fine-tune on one GPU at seq 4096: the optimizer (12 bytes per parameter in bf16)
    leaves the GPU estimate and is shown in host memory, which brings the estimate under 80 GB."""
    def plan(offload: bool):
        job = {
            "model": {"path": str(HF_CONFIGS / "qwen2_5_7b")},
            "data": {"train_files": [str(FIXTURES / "data" / "sft.jsonl")], "seq_length": 4096},
            "cluster": {"device": "cuda", "nproc_per_node": 1},
            "trainer": {"global_batch_size": 1, "micro_batch_size": 1},
            "actor_rollout_ref": {"actor": {"megatron": {"optimizer_offload": offload, "override_transformer_config": {
                "recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}}}},
        }
        loaded = load_config(write_job(job))
        return build_plan(loaded.config, loaded.facts, loaded.warnings)

    on, off = plan(True), plan(False)
    m, base = on.roles[0].memory, off.roles[0].memory
    params = m.params_per_gpu
    assert params == base.params_per_gpu > 7e9
    assert base.optimizer == 12 * params and base.host_optimizer == 0
    assert m.optimizer == 0 and m.host_optimizer == 12 * params
    assert (m.weights, m.grads, m.activations, m.logits) == (base.weights, base.grads, base.activations, base.logits)
    assert off.peak_per_gpu - on.peak_per_gpu == 12 * params
    assert on.peak_per_gpu < 78 * 2**30 < off.peak_per_gpu
    text = render_plan(on)
    assert f"optimizer 0 B (in host memory: {12 * params / 2**30:.2f} GiB per rank, optimizer_offload)" in text


def test_context_parallel_divides_activations_logits_and_the_sharded_optimizer(write_job):
    """TP=2 x CP=2 x DP=2 against TP=2 x DP=4 (8 GPUs): each CP rank holds half of every row (activations
    and logits halve), and megatron's distributed optimizer shards over DP x CP (= 4 either way)."""
    (base,) = _plan(write_job).roles
    (cp,) = _plan(write_job, context_parallel_size=2).roles
    assert cp.layout == "TP=2 PP=1 CP=2 DP=2" and cp.dp == 2 and base.dp == 4
    assert cp.memory.params_per_gpu == base.memory.params_per_gpu
    assert cp.memory.optimizer == base.memory.optimizer == 12 * base.memory.params_per_gpu // 4
    assert cp.memory.activations * 2 == base.memory.activations
    assert cp.memory.logits * 2 == base.memory.logits
