"""Sequence parallel in the RL roles (#20): PPO (actor, ref, critic) at TP=2 with sequence_parallel gives
the rollout, log-probs, values, losses and updated weights of TP=2 without it and of TP=1.

With SP the training, log-prob and value forwards split the sequence over the TP ranks (rows padded to
a multiple of TP at the right, `trinity.trainer.recipes.rollout_forward.forward_output`); the rollout
decodes with SP switched off on the same modules (`trinity.distributed.sequence_parallel`). Each job is
a real `trinity run` (config -> torchrun -> worker), two steps, so step 2's rollout and log-probs come
from the weights step 1 updated."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import trinity_run

NOT_DETERMINISTIC = ("time/", "tokens_per_s/", "mem/", "step_time_s")


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    from trinity.testing.tiny_assets import make_tiny_qwen2, make_tiny_tokenizer, write_prompt_dataset

    root = tmp_path_factory.mktemp("rl_sp_assets")
    tok = make_tiny_tokenizer(root / "tokenizer")
    model = make_tiny_qwen2(root / "model", tok, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)
    return {"model": model, "data": write_prompt_dataset(root / "prompts.jsonl", 16, seed=0)}


def ppo_job(assets: dict[str, Path], out: Path, *, tp: int, sp: bool) -> dict:
    block = {"tensor_model_parallel_size": tp, "sequence_parallel": sp}
    return {
        "algorithm": {"name": "ppo", "use_kl_in_reward": True},
        "model": {"path": str(assets["model"])},
        # val_files: the evaluation after the last step decodes through the same switch (greedy)
        "data": {"train_files": [str(assets["data"])], "val_files": [str(assets["data"])], "max_prompt_length": 32,
                 "train_batch_size": 4},
        "cluster": {"device": "cpu", "nproc_per_node": tp},
        "trainer": {"total_steps": 2, "micro_batch_size": 4, "output_dir": str(out), "save_interval": 100,
                    "log_interval": 1, "tensorboard": False, "export_hf": True, "val_before_train": False},
        "actor_rollout_ref": {
            "actor": {"ppo_mini_batch_size": 2, "entropy_coeff": 0.01, "optim": {"lr": 1e-3, "weight_decay": 0.0},
                      "megatron": dict(block)},
            "ref": {"megatron": dict(block)},
            "rollout": {"n": 2, "response_length": 7},
        },
        "critic": {"optim": {"lr": 1e-3, "weight_decay": 0.0}, "megatron": dict(block)},
        "reward": {"function": "trinity.rewards.arithmetic_reward:closeness"},
    }


def _run(assets: dict[str, Path], tmp: Path, name: str, **layout) -> tuple[list[dict], dict[str, torch.Tensor]]:
    out = tmp / name
    proc = trinity_run(ppo_job(assets, out, **layout), tmp / f"{name}.yaml", timeout=300, reuse_conversion=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    (val,) = [r for r in rows if "val/reward_mean" in r]
    rows = [r for r in rows if "val/reward_mean" not in r] + [val]
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted((out / "hf").glob("*.safetensors")):
        weights.update(load_file(str(shard)))
    return rows, weights


def _assert_same(a: list[dict], b: list[dict], what: str, skip: tuple[str, ...] = ()) -> None:
    """Two training steps, then the evaluation after the last one."""
    assert len(a) == len(b) == 3
    for ra, rb in zip(a, b):
        numbers = sorted(k for k, v in ra.items() if isinstance(v, (int, float)) and not k.startswith(NOT_DETERMINISTIC)
                         and not k.endswith(skip))
        keys = ("val/reward_mean", "val/response_length/mean") if "val/reward_mean" in ra else (
            "actor/pg_loss", "critic/vf_loss", "critic/vpred_mean", "actor/ref_kl", "reward/mean",
            "response_length/mean", "actor/grad_norm", "critic/grad_norm")
        for key in keys:
            assert key in numbers, key
        assert sorted(k for k in rb if k in numbers) == numbers
        for key in numbers:
            assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-6), (what, ra["step"], key, ra[key], rb[key])


@pytest.mark.multiproc
@pytest.mark.slow
def test_ppo_with_sequence_parallel_equals_tp1(assets, tmp_path):
    """PPO (actor, ref and critic) at TP=2 with sequence parallel gives TP=1's metrics and weights (TP=2
    without SP runs a subset of these code paths)."""
    sp_rows, sp_weights = _run(assets, tmp_path, "tp2_sp", tp=2, sp=True)
    tp1_rows, tp1_weights = _run(assets, tmp_path, "tp1", tp=1, sp=False)
    # the same sampled responses (same tokens and lengths), log-probs, values, KL, losses, grad norms.
    # Not the clip fractions: vf_clipfrac counts tokens whose clipped error exceeds the unclipped one;
    # where the clip is not active both are the same number up to one rounding of `old + (v - old)`, so
    # with another summation order (SP's reduce-scatter, TP=1) that count differs on ties; the losses
    # themselves are compared.
    _assert_same(tp1_rows, sp_rows, "tp1 vs tp2+sp", skip=("clipfrac",))
    assert sp_rows[0]["response_length/mean"] > 1
    # the weights after two updates
    assert sorted(sp_weights) == sorted(tp1_weights)
    for name, w in sp_weights.items():
        torch.testing.assert_close(w, tp1_weights[name], rtol=1e-4, atol=1e-5, msg=name)
    base = load_file(str(assets["model"] / "model.safetensors"))
    moved = max((sp_weights[n] - base[n]).abs().max().item() for n in base)
    assert moved > 1e-4  # the updates did change the weights


# --- VPP in the forward-only passes (#20) ------------------------------------------------------------
# The RL rollout with VPP is tested in tests/integration/test_rollout_pp.py. The forward-only pass the
# RL roles share with DPO (`trinity.trainer.engine.forward_only`: ref / old log-probs, values, DPO's reference) runs megatron's
# interleaved schedule; DPO exercises it end to end.


@pytest.fixture(scope="module")
def dpo_assets(tmp_path_factory) -> dict[str, Path]:
    from trinity.testing.tiny_assets import make_tiny_qwen2, make_tiny_tokenizer, write_dpo_dataset

    root = tmp_path_factory.mktemp("dpo_vpp_assets")
    tok = make_tiny_tokenizer(root / "tokenizer")
    model = make_tiny_qwen2(root / "model", tok, num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2)
    return {"model": model, "data": write_dpo_dataset(root / "pairs.jsonl", 32, seed=0)}


def dpo_job(assets: dict[str, Path], out: Path, *, pp: int, vpp: int | None, micro: int) -> dict:
    block = {"pipeline_model_parallel_size": pp, "virtual_pipeline_model_parallel_size": vpp}
    return {
        "algorithm": {"name": "dpo", "dpo": {"beta": 0.1}},
        "model": {"path": str(assets["model"])},
        "data": {"train_files": [str(assets["data"])], "seq_length": 48},
        "cluster": {"device": "cpu", "nproc_per_node": pp},
        "trainer": {"total_steps": 2, "global_batch_size": 4, "micro_batch_size": micro, "output_dir": str(out),
                    "save_interval": 100, "log_interval": 1, "tensorboard": False, "export_hf": False},
        "actor_rollout_ref": {"actor": {"optim": {"lr": 3e-3, "weight_decay": 0.0}, "megatron": dict(block)},
                              "ref": {"megatron": dict(block)}},
    }


@pytest.mark.multiproc
@pytest.mark.slow
def test_dpo_with_vpp_equals_pp1(dpo_assets, tmp_path):
    """PP=2 x VPP=2 (4 layers, one per chunk) with 4 micro batches per step: the reference's forward-only
    interleaved pass and the actor's interleaved
    update give PP=1's losses and log-probs. Step 2's reference log-probs and losses come after an update."""
    res = {}
    for name, pp, vpp, micro in (("pp1", 1, None, 2), ("vpp", 2, 2, 1)):
        out = tmp_path / name
        proc = trinity_run(dpo_job(dpo_assets, out, pp=pp, vpp=vpp, micro=micro), tmp_path / f"{name}.yaml", timeout=300, reuse_conversion=True)
        assert proc.returncode == 0, proc.stdout[-3000:]
        res[name] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in res["vpp"]] == [1, 2]
    assert res["vpp"][0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference at step 1
    for a, b in zip(res["pp1"], res["vpp"]):
        for key in ("loss", "rewards/margins", "logps/chosen", "logps/rejected", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-5), (a["step"], key, a[key], b[key])
