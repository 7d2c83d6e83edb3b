"""The shipped SFT configs validate against real HF config.json fixtures (no weights, no GPU)."""

from __future__ import annotations

from pathlib import Path

from trinity.config.loader import load_config

REPO = Path(__file__).resolve().parents[2]
HF_CONFIGS = REPO / "tests" / "fixtures" / "hf_configs"


def test_sft_qwen2_7b_8gpu_validates_on_the_7b_config():
    loaded = load_config(
        REPO / "configs" / "sft_qwen2_7b_8gpu.yaml", [f"model.path={HF_CONFIGS / 'qwen2_5_7b'}"], check_paths=False
    )
    cfg = loaded.config
    m = cfg.actor_rollout_ref.actor.megatron
    assert cfg.algorithm.name.value == "sft" and cfg.cluster.world_size == 8
    assert m.layout().dp(cfg.cluster.world_size) == 4
    assert loaded.facts.num_layers == 28
    assert cfg.trainer.global_batch_size % (cfg.trainer.micro_batch_size * 4) == 0


def test_quickstart_validates_on_the_tiny_assets(tmp_path, monkeypatch):
    from trinity.testing.tiny_assets import make_tiny_qwen2, make_tiny_tokenizer, write_sft_dataset

    tok = make_tiny_tokenizer(tmp_path / "quickstart_assets" / "tok")
    make_tiny_qwen2(tmp_path / "quickstart_assets" / "model", tok)
    write_sft_dataset(tmp_path / "quickstart_assets" / "data" / "sft_train.jsonl", 10, seed=0)
    monkeypatch.chdir(tmp_path)  # the quickstart's paths are relative to where `trinity run` starts
    loaded = load_config(REPO / "configs" / "quickstart.yaml")
    assert loaded.config.cluster.device == "cpu" and loaded.config.cluster.world_size == 1
