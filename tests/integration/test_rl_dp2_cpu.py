"""GRPO at DP=2 on CPU (gloo) through `trinity run`, under the strict collectives guard the suite runs with:
the update's reductions over the data-parallel group, the metrics of both ranks, and their sampling seeds.

Every prompt of the dataset is the same one, so both ranks answer the same prompt at each step: at
temperature 1 their answers must differ (ranks that share a sampling seed answer alike, and GRPO then
trains on copies). The GPU matrix (tests/gpu/test_scale_gpu.py) checks the same on NCCL.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.gpu.jobs import check_ranks_differ
from tests.integration.test_rl_cpu import assets, job, rows, run_job  # noqa: F401 (assets is a fixture)


@pytest.mark.slow  # a torchrun job of two ranks: ~40 s on 2 cores
@pytest.mark.multiproc
def test_grpo_dp2_reduces_over_both_ranks_and_their_answers_differ(assets, tmp_path):
    prompt = json.loads(Path(assets["data"]).read_text().splitlines()[0])
    same = tmp_path / "same.jsonl"
    same.write_text((json.dumps(prompt) + "\n") * 16)
    out = tmp_path / "grpo"
    cfg = job({**assets, "data": same}, out, "grpo", 2)
    cfg["cluster"]["nproc_per_node"] = 2
    cfg["trainer"].update(save_interval=None, save_last=False, log_samples=1)
    cfg["actor_rollout_ref"]["rollout"].update(n=4, temperature=1.0)
    log = run_job(cfg, tmp_path / "grpo.yaml")
    assert "DP=2" in log
    steps = rows(out)
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["reward/mean"] == r["reward/mean"] and r["actor/pg_loss"] == r["actor/pg_loss"]
        # both ranks' tokens are counted: 4 prompts x 4 answers over the two ranks
        assert r["response_length/mean"] > 0
    for step in (1, 2):
        samples = (out / "samples" / f"step_{step}.jsonl").read_text().splitlines()
        assert len(samples) == 16, len(samples)  # every rank's answers are gathered
        check_ranks_differ(out, dp=2, step=step)
