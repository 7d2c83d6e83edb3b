"""A multi-turn workflow job on 2 GPUs (DP=2, NCCL, bf16) through `trinity run`: GRPO on the guess-number game
with the tiny Qwen2 of tests/gpu/jobs.py. Every phase runs on both ranks, conversations of several turns are
trained, and the engine's log-probs of the assistant tokens match one training forward over the whole
conversation within bf16 noise.

Run on a 2-GPU machine: `python -m pytest tests/gpu/test_workflow_gpu.py -q -s`.
"""

from __future__ import annotations

import pytest

from tests.gpu.jobs import make_assets, note, rl_job, run_job

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.multiproc,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


def test_guess_number_grpo_at_dp2(tmp_path):
    from trinity.workflows.guess_number import write_tasks

    assets = make_assets(tmp_path / "assets")
    tasks = tmp_path / "tasks.jsonl"
    write_tasks(str(tasks), 64, seed=0, high=9)
    out = tmp_path / "wf_dp2"
    cfg = rl_job(assets, "grpo", out, 2, steps=3)
    del cfg["reward"]
    cfg["data"].update(train_files=[str(tasks)], max_prompt_length=256)
    cfg["actor_rollout_ref"]["rollout"].update(n=4, response_length=8)
    cfg["workflow"] = {"function": "guess_number", "max_turns": 3}
    rows = run_job(cfg, tmp_path / "wf_dp2.yaml")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for phase in ("rollout", "ref", "update_actor"):
            assert r[f"time/{phase}_s"] > 0, phase
        assert 1.0 < r["workflow/turns_mean"] <= 3.0, r
        assert r["workflow/end_error"] == 0.0 and 0.0 <= r["reward/mean"] <= 1.0
        assert r["rollout/logprob_diff_mean"] < 0.05, r
    note(f"  workflow dp2: turns {[round(r['workflow/turns_mean'], 2) for r in rows]}; reward "
         f"{[round(r['reward/mean'], 3) for r in rows]}; logprob gap {[round(r['rollout/logprob_diff_mean'], 4) for r in rows]}")
