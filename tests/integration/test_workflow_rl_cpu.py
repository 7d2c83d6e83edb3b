"""A workflow job end to end on CPU through `trinity run`: GRPO on the guess-number game with the tiny random
Qwen2 (every phase runs, conversations of several turns are trained, the sampled log-probs of their
assistant tokens equal the training forward's over the whole conversation), and a run resumed from its
step-2 checkpoint repeats step 3 of the uninterrupted run."""

from __future__ import annotations

import json
import re

import pytest

from tests.integration.test_rl_cpu import RESUME_KEYS, assert_same_step, job, resume_at_step_2, rows, run_job


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from trinity.testing.tiny_assets import make_tiny_qwen2, make_tiny_tokenizer
    from trinity.workflows.guess_number import write_tasks

    root = tmp_path_factory.mktemp("wf_assets")
    tok = make_tiny_tokenizer(root / "tokenizer")
    model = make_tiny_qwen2(root / "model", tok, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)
    write_tasks(str(root / "tasks.jsonl"), 32, seed=0, high=9)
    return {"model": model, "data": root / "tasks.jsonl"}


@pytest.mark.slow
def test_guess_number_grpo_trains_conversations_and_resumes_exactly(assets, tmp_path):
    out = tmp_path / "wf"
    cfg = job(assets, out, "grpo", 3)
    del cfg["reward"]
    cfg["data"]["max_prompt_length"] = 256
    cfg["actor_rollout_ref"]["rollout"]["response_length"] = 8
    cfg["trainer"]["log_samples"] = 1
    cfg["workflow"] = {"function": "guess_number", "max_turns": 3}
    run_job(cfg, tmp_path / "a.yaml")
    first = rows(out)
    assert [r["step"] for r in first] == [1, 2, 3]
    for r in first:
        for phase in ("rollout", "ref", "old_logp", "update_actor"):
            assert r[f"time/{phase}_s"] > 0, phase
        assert isinstance(r["actor/pg_loss"], float) and 0.0 <= r["reward/mean"] <= 1.0
        # a random model rarely finds the secret: most episodes take several turns (tokens of the user's
        # feedback masked out between them)
        assert 1.0 < r["workflow/turns_mean"] <= 3.0, r
        assert r["workflow/sequences"] == 8 and r["workflow/end_error"] == 0.0
        assert sum(r[f"workflow/end_{k}"] for k in ("finished", "max_turns", "context_limit")) == pytest.approx(1.0)
        # the engine's log-probs of every assistant token equal one forward over the whole conversation
        assert r["rollout/logprob_diff_max"] < 1e-4, r
    # the logged samples are whole conversations, the game's feedback between the guesses
    logged = [json.loads(line) for line in (out / "samples" / "step_1.jsonl").read_text().splitlines()]
    assert len(logged) == 8 and sum(s["response"].count("\n[user] ") for s in logged) >= 4, logged
    assert all(re.fullmatch(r"(\[assistant\] .*\n\[user\] (Higher|Lower|Answer with one integer)\.\n)*"
                            r"\[assistant\] .*", s["response"], flags=re.DOTALL) for s in logged), logged
    again = resume_at_step_2(cfg, out, tmp_path / "b.yaml")
    assert again[:2] == first[:2]
    assert_same_step(first[2], again[2], RESUME_KEYS + ("workflow/turns_mean",))
