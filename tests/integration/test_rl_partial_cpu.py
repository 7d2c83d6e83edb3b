"""Partial rollouts in a real GRPO job (CPU, the tiny model): answers are carried over between steps, the
importance-weight and staleness metrics are logged, and a job resumed from a checkpoint taken while
answers were carried over gives the uninterrupted run's metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.integration.test_rl_cpu import assert_same_step, job, rows, run_job


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    from trinity.testing.tiny_assets import make_tiny_qwen2, make_tiny_tokenizer, write_prompt_dataset

    root = tmp_path_factory.mktemp("partial_assets")
    tok = make_tiny_tokenizer(root / "tokenizer")
    model = make_tiny_qwen2(root / "model", tok, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)
    # a random model rarely samples its one EOS: 40 of the ~260 tokens end an answer here (about one
    # token in six), so that answers end at different lengths and some are still running when a step's
    # groups are complete
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": list(range(40, 80))}))
    return {"model": model, "data": write_prompt_dataset(root / "prompts.jsonl", 64, seed=0)}


@pytest.mark.slow
def test_partial_grpo_carries_answers_and_resumes_exactly(assets, tmp_path):
    out = tmp_path / "partial"
    cfg = job(assets, out, "grpo", 3)
    cfg["actor_rollout_ref"]["rollout"].update(response_length=12, partial={"enable": True})
    cfg["actor_rollout_ref"]["actor"]["use_kl_loss"] = False  # no ref model: a shorter job
    del cfg["actor_rollout_ref"]["ref"]
    run_job(cfg, tmp_path / "a.yaml")
    first = rows(out)
    assert [r["step"] for r in first] == [1, 2, 3]
    for r in first:
        for key in ("rollout/carried_over", "rollout/staleness_mean", "rollout/is_weight_mean",
                    "rollout/is_weight_max", "rollout/is_clipped_fraction"):
            assert isinstance(r[key], float), key
        assert 0 < r["rollout/is_weight_mean"] <= r["rollout/is_weight_max"] <= 2.0
        assert r["rollout/staleness_mean"] <= 1.0  # max_staleness 1
    assert first[0]["rollout/staleness_mean"] == 0.0  # nothing older than the first step's policy
    assert any(r["rollout/staleness_mean"] > 0 for r in first[1:])  # carried tokens were trained later
    state = torch.load(out / "checkpoints" / "step_2" / "rank_state" / "rank_0.pt", weights_only=True)
    running = [a for g in state["carry"] for a in g["answers"] if a["tokens"] and not a["ended"]]
    assert running and first[1]["rollout/carried_over"] == len(running)  # the checkpoint holds half-done answers

    resumed = dict(cfg, trainer={**cfg["trainer"], "resume": str(out / "checkpoints" / "step_2")})
    run_job(resumed, tmp_path / "b.yaml")
    again = rows(out)
    assert [r["step"] for r in again] == [1, 2, 3]
    for a, b in zip(first[2:], again[2:]):
        assert_same_step(a, b, ("actor/pg_loss", "reward/mean", "actor/grad_norm", "rollout/is_weight_mean"))
