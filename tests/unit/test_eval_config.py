"""Evaluation, samples, trackers and hub-id options: each rule names its key, and a hub id in model.path
resolves through a huggingface_hub cache folder built by hand (no network)."""

from __future__ import annotations

import copy
import importlib.util
import shutil

import pytest

from tests.conftest import FIXTURES, HF_CONFIGS
from trinity.config.loader import load_config
from trinity.errors import ConfigError


def problems_of(path):
    with pytest.raises(ConfigError) as err:
        load_config(path)
    return err.value.problems


def rl(job):
    job = copy.deepcopy(job)
    job["algorithm"] = {"name": "grpo"}
    job["data"] = {"train_files": [str(FIXTURES / "data" / "prompts.jsonl")]}
    return job


def test_val_options_are_accepted(write_job, small_job):
    job = copy.deepcopy(small_job)
    job["data"]["val_files"] = small_job["data"]["train_files"]
    job["trainer"].update(val_interval=5, val_before_train=False, logger=["console", "jsonl"])
    cfg = load_config(write_job(job)).config
    assert cfg.data.val_files == small_job["data"]["train_files"]
    assert (cfg.trainer.val_interval, cfg.trainer.val_before_train) == (5, False)
    assert cfg.trainer.trackers() == []


def test_val_interval_needs_val_files(write_job, small_job):
    job = copy.deepcopy(small_job)
    job["trainer"]["val_interval"] = 5
    assert any(p.startswith("trainer.val_interval: there is nothing to evaluate without data.val_files")
               for p in problems_of(write_job(job)))


def test_val_kwargs_take_verl_names_and_are_refused_where_they_cannot_act(write_job, small_job):
    key = "actor_rollout_ref.rollout.val_kwargs"
    job = rl(small_job)
    job["data"]["val_files"] = job["data"]["train_files"]
    # verl's own block, as its configs write it (top_k -1 = off), and rollout.top_k -1 likewise
    job["actor_rollout_ref"] = {"rollout": {"top_k": -1, "val_kwargs": {
        "top_k": -1, "top_p": 0.9, "temperature": 0.6, "n": 4, "do_sample": True}}}
    ro = load_config(write_job(job)).config.actor_rollout_ref.rollout
    assert ro.top_k == 0 and (ro.val_kwargs.top_k, ro.val_kwargs.n, ro.val_kwargs.temperature) == (0, 4, 0.6)
    # without do_sample the evaluation is greedy: settings it would ignore are refused, each named
    job["actor_rollout_ref"]["rollout"]["val_kwargs"]["do_sample"] = False
    assert (f"{key}.temperature: the evaluation decodes greedily (one response per prompt) unless {key}.do_sample "
            "is true; set do_sample: true or remove temperature, top_p, n") in problems_of(write_job(job))
    # no val files, or an algorithm without a rollout
    job["actor_rollout_ref"]["rollout"]["val_kwargs"]["do_sample"] = True
    del job["data"]["val_files"]
    assert (f"{key}: there is no evaluation without data.val_files; add data.val_files or remove the key"
            in problems_of(write_job(job)))
    sft = copy.deepcopy(small_job)
    sft["actor_rollout_ref"] = {"rollout": {"val_kwargs": {"do_sample": True}}}
    assert any(p.startswith(f"{key}: sft evaluates without generating") for p in problems_of(write_job(sft)))


def test_missing_val_file_is_named(write_job, small_job, tmp_path):
    job = copy.deepcopy(small_job)
    job["data"]["val_files"] = [str(tmp_path / "nope.jsonl")]
    assert f"data.val_files.0: {tmp_path / 'nope.jsonl'} does not exist" in problems_of(write_job(job))


def test_log_samples_is_refused_for_sft(write_job, small_job):
    job = copy.deepcopy(small_job)
    job["trainer"].update(log_samples=3, log_samples_interval=10, log_interval=5)
    problems = problems_of(write_job(job))
    assert "trainer.log_samples: sft generates no samples (it applies to the RL algorithms); remove the key" in problems
    assert "trainer.log_samples_interval: sft generates no samples (it applies to the RL algorithms); remove the key" in problems
    job = rl(job)
    trainer = load_config(write_job(job)).config.trainer
    assert (trainer.samples_per_step(True), trainer.samples_interval()) == (3, 10)
    del job["trainer"]["log_samples_interval"]  # unset: the step lines' interval
    assert load_config(write_job(job)).config.trainer.samples_interval() == 5


def test_tensorboard_and_logger_together_are_refused(write_job, small_job):
    job = copy.deepcopy(small_job)
    job["trainer"].update(tensorboard=False, logger=["jsonl"])
    assert any(p.startswith("trainer.tensorboard: set trainer.logger or trainer.tensorboard, not both")
               for p in problems_of(write_job(job)))


def test_trainer_tensorboard_still_decides_without_logger(write_job, small_job):
    job = copy.deepcopy(small_job)
    assert load_config(write_job(job)).config.trainer.trackers() == ["tensorboard"]
    job["trainer"]["tensorboard"] = False
    assert load_config(write_job(job)).config.trainer.trackers() == []


MISSING = [name for name, module in (("tensorboard", "tensorboard"), ("wandb", "wandb"), ("mlflow", "mlflow"))
           if importlib.util.find_spec(module) is None]


@pytest.mark.skipif(not MISSING, reason="tensorboard, wandb and mlflow are all installed here: no missing tracker to report")
def test_missing_tracker_package_is_one_line_with_the_pip_command(write_job, small_job):
    name = MISSING[0]
    job = copy.deepcopy(small_job)
    job["trainer"]["logger"] = ["console", name]
    (problem,) = [p for p in problems_of(write_job(job)) if p.startswith("trainer.logger")]
    assert problem.startswith(f"trainer.logger: {name} is not installed; run `pip install ")


# ---------------------------------------------------------------- hub ids


def hub_cache(root, repo_id, src):
    """huggingface_hub's cache layout by hand: models--org--name/{refs/main, snapshots/<rev>/...}."""
    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    snap = repo / "snapshots" / rev
    shutil.copytree(src, snap)
    return snap


def test_hub_id_resolves_through_a_warm_cache(write_job, small_job, tmp_path, monkeypatch):
    snap = hub_cache(tmp_path / "hub", "Qwen/Qwen2.5-0.5B-Instruct", HF_CONFIGS / "qwen2_5_0_5b")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    job = copy.deepcopy(small_job)
    job["model"]["path"] = "Qwen/Qwen2.5-0.5B-Instruct"
    loaded = load_config(write_job(job))
    assert loaded.config.model.path == str(snap)
    assert loaded.facts.num_layers == 24


def test_hub_id_offline_without_cache_is_one_line(write_job, small_job, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    job = copy.deepcopy(small_job)
    job["model"]["path"] = "Qwen/Qwen2.5-0.5B-Instruct"
    (problem,) = [p for p in problems_of(write_job(job)) if p.startswith("model.path")]
    assert "\n" not in problem
    assert problem.startswith("model.path: Qwen/Qwen2.5-0.5B-Instruct is not a local folder and not in the Hugging Face cache")
    assert "pass a local folder, or set HF_HUB_OFFLINE with a warm cache" in problem


def test_a_local_folder_wins_over_a_hub_id(tmp_path, monkeypatch):
    from trinity.models.hub import resolve_model_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert resolve_model_path("org/name") == "org/name"


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed (pip install wandb)")
def test_wandb_without_a_key_is_refused_unless_offline(write_job, small_job, tmp_path, monkeypatch):
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    job = copy.deepcopy(small_job)
    job["trainer"]["logger"] = ["console", "wandb"]
    path = write_job(job)
    assert any(p.startswith("trainer.logger: wandb has no API key here") for p in problems_of(path))
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert load_config(path).config.trainer.trackers() == ["wandb"]
