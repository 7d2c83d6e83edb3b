"""Evaluation during training, RL samples and trackers, end to end on CPU through `trinity run`.

- SFT: with the val file equal to the training file and a single step over exactly those rows, the val
  loss before step 1 is step 1's training loss (the same formula over the same rows, forward only).
- GRPO: val rows at steps 0 (before training), every val_interval and the last step, with finite
  greedy pass@1; every step's samples in samples/step_N.jsonl and a few on the console; the wandb
  (offline) and mlflow (file store) runs hold the config and the metrics.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest

from tests.conftest import trinity_run

HAVE_WANDB = importlib.util.find_spec("wandb") is not None
HAVE_MLFLOW = importlib.util.find_spec("mlflow") is not None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    from trinity.testing.tiny_assets import (make_tiny_qwen2, make_tiny_tokenizer, write_prompt_dataset,
                                             write_sft_dataset)

    root = tmp_path_factory.mktemp("eval_assets")
    tok = make_tiny_tokenizer(root / "tokenizer")
    model = make_tiny_qwen2(root / "model", tok, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)
    return {
        "model": model,
        "sft": write_sft_dataset(root / "sft.jsonl", 8, seed=0),
        "prompts": write_prompt_dataset(root / "prompts.jsonl", 16, seed=0),
        "val_prompts": write_prompt_dataset(root / "val_prompts.jsonl", 6, seed=1),
    }


def grpo_job(tiny: dict[str, Path], out: Path, trainer: dict, *, lr: float) -> dict:
    """GRPO on the tiny model: 4 prompts x 2 answers of 6 tokens a step, the val prompts evaluated."""
    return {
        "algorithm": {"name": "grpo"},
        "model": {"path": str(tiny["model"])},
        "data": {"train_files": [str(tiny["prompts"])], "val_files": [str(tiny["val_prompts"])],
                 "max_prompt_length": 32, "train_batch_size": 4},
        "cluster": {"device": "cpu", "nproc_per_node": 1},
        "trainer": {"micro_batch_size": 4, "output_dir": str(out), "export_hf": False, **trainer},
        "actor_rollout_ref": {
            "actor": {"ppo_mini_batch_size": 4, "optim": {"lr": lr, "weight_decay": 0.0}},
            "rollout": {"n": 2, "response_length": 6},
        },
        "reward": {"function": "trinity.rewards.arithmetic_reward:closeness"},
    }


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_sft_val_loss_before_training_equals_step_1_loss(tiny, tmp_path):
    out = tmp_path / "run"
    cfg = {
        "algorithm": {"name": "sft"},
        "model": {"path": str(tiny["model"])},
        # padding, not packing: 8 samples are exactly the 8 rows of the one global batch
        "data": {"train_files": [str(tiny["sft"])], "val_files": [str(tiny["sft"])], "seq_length": 64, "packing": False},
        "cluster": {"device": "cpu", "nproc_per_node": 1},
        "trainer": {"total_steps": 1, "global_batch_size": 8, "micro_batch_size": 2, "output_dir": str(out),
                    "tensorboard": False, "export_hf": False},
        "actor_rollout_ref": {"actor": {"optim": {"lr": 1e-2, "weight_decay": 0.0}}},
    }
    proc = trinity_run(cfg, tmp_path / "job.yaml", timeout=170, reuse_conversion=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    val = [r for r in rows(out) if "val/loss" in r]
    train = [r for r in rows(out) if "loss" in r]
    assert [r["step"] for r in val] == [0, 1] and [r["step"] for r in train] == [1]
    assert math.isfinite(val[1]["val/loss"])
    assert abs(val[0]["val/loss"] - train[0]["loss"]) < 1e-5, (val, train)
    # the step trained on these very rows at a high LR: the loss after it is lower
    assert val[1]["val/loss"] < val[0]["val/loss"] - 1e-3
    assert "val step 0/1 | val/loss" in proc.stdout
    # the closing summary: the first and last val loss
    assert re.search(rf"\n\[default0\]:  val/loss +{val[0]['val/loss']:.4f} \(step 0\) -> {val[1]['val/loss']:.4f} \(step 1\)\n",
                     proc.stdout), proc.stdout[-3000:]


@pytest.mark.slow
def test_grpo_val_reward_samples_and_trackers(tiny, tmp_path, monkeypatch):
    out = tmp_path / "run"
    loggers = ["console", "jsonl"] + (["wandb"] if HAVE_WANDB else []) + (["mlflow"] if HAVE_MLFLOW else [])
    cfg = grpo_job(tiny, out, {"total_steps": 3, "val_interval": 2, "log_samples": 2, "logger": loggers}, lr=1e-3)
    proc = trinity_run(cfg, tmp_path / "job.yaml", timeout=240, reuse_conversion=True, env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert proc.returncode == 0, proc.stdout[-3000:]
    val = [r for r in rows(out) if "val/reward_mean" in r]
    assert [r["step"] for r in val] == [0, 2, 3]
    for r in val:
        assert 0.0 <= r["val/reward_mean"] <= 1.0 and math.isfinite(r["val/reward_std"])
        assert 0 < r["val/response_length/mean"] <= 6
    assert "val step 0/3 | val/reward_mean" in proc.stdout

    # samples: every response of every step, a few printed
    for step in (1, 2, 3):
        lines = [json.loads(x) for x in (out / "samples" / f"step_{step}.jsonl").read_text().splitlines()]
        assert len(lines) == 4 * 2
        assert all(set(s) >= {"step", "prompt", "response", "reward", "answer"} and s["step"] == step for s in lines)
        train = next(r for r in rows(out) if r["step"] == step and "reward/mean" in r)
        assert abs(sum(s["reward"] for s in lines) / len(lines) - train["reward/mean"]) < 1e-6
    val_samples = (out / "samples" / "val_step_0.jsonl").read_text().splitlines()
    assert len(val_samples) == 6
    assert proc.stdout.count("]:  sample 1/8 of step ") == 3 and "  sample 3/8" not in proc.stdout
    assert "]:  val sample 1/6 of step 0 | reward " in proc.stdout
    # the closing summary: reward and val reward, the samples, and the trackers' runs
    summary = proc.stdout[proc.stdout.index(f"[default0]:run summary: {out}\n"):]
    assert re.search(r"\]:  reward/mean +[0-9.]+ \(step 1\) -> [0-9.]+ \(step 3\)\n", summary), summary
    assert re.search(rf"\]:  val/reward_mean +{val[0]['val/reward_mean']:.4f} \(step 0\) -> {val[-1]['val/reward_mean']:.4f} \(step 3\)\n", summary), summary
    assert re.search(rf"\]:  samples +{re.escape(str(out / 'samples'))}\n", summary), summary
    if HAVE_MLFLOW:
        assert re.search(rf"\]:  mlflow +file:{re.escape(str((out / 'mlruns').resolve()))} \(run [0-9a-f]+\)\n", summary), summary
    if HAVE_WANDB:
        assert re.search(rf"\]:  wandb +{re.escape(str(out))}/wandb/offline-run-\S+\n", summary), summary

    if HAVE_MLFLOW:
        from mlflow.tracking import MlflowClient

        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # as the run itself sets it for its default store

        client = MlflowClient(tracking_uri=f"file:{out / 'mlruns'}")
        (run,) = client.search_runs([client.get_experiment_by_name("trinity").experiment_id])
        assert run.info.run_name == "run"
        assert run.data.params["algorithm.name"] == "grpo"
        history = client.get_metric_history(run.info.run_id, "val/reward_mean")
        assert [m.step for m in history] == [0, 2, 3]
        assert [m.value for m in history] == [r["val/reward_mean"] for r in val]
        assert len(client.get_metric_history(run.info.run_id, "reward/mean")) == 3
    if HAVE_WANDB:
        (run_dir,) = (out / "wandb").glob("offline-run-*")
        (log,) = run_dir.glob("run-*.wandb")
        # an offline run is one protobuf record log (what `wandb sync` uploads); its strings are stored as is
        data = log.read_bytes()
        assert b"val_interval" in data and b'"grpo"' in data  # the job config
        assert b"val/reward_mean" in data and b"reward/mean" in data  # the metrics


def test_grpo_val_kwargs_sample_n_responses_per_prompt_from_the_seed(tiny, tmp_path):
    # verl's rollout.val_kwargs: 3 sampled responses per val prompt at temperature 1; every evaluation draws
    # from trainer.seed afresh, so with an update too small to move an fp32 weight (lr 1e-12: Adam's step is
    # far below an fp32 ulp of the weights) the evaluations before and after it are the same
    out = tmp_path / "grpo_val_sampled"
    cfg = grpo_job(tiny, out, {"total_steps": 1, "save_last": False, "log_samples": 1}, lr=1e-12)
    cfg["actor_rollout_ref"]["rollout"]["val_kwargs"] = {"do_sample": True, "temperature": 1.0, "n": 3, "top_k": -1}
    proc = trinity_run(cfg, tmp_path / "job.yaml", timeout=240, reuse_conversion=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    val = [r for r in rows(out) if "val/reward_mean" in r]
    assert [r["step"] for r in val] == [0, 1] and val[0] == {**val[1], "step": 0}
    samples = [json.loads(x) for x in (out / "samples" / "val_step_0.jsonl").read_text().splitlines()]
    assert len(samples) == 6 * 3
    by_prompt: dict[str, list[str]] = {}
    for s in samples:
        by_prompt.setdefault(s["prompt"], []).append(s["response"])
    assert len(by_prompt) == 6 and all(len(r) == 3 for r in by_prompt.values())
    assert sum(len(set(r)) > 1 for r in by_prompt.values()) >= 5  # sampled, not greedy copies
    assert abs(sum(s["reward"] for s in samples) / len(samples) - val[0]["val/reward_mean"]) < 1e-6
