"""Context parallelism on 2 and 4 GPUs through `trinity run` (torchrun, NCCL, bf16), without TransformerEngine
(ring attention, trinity.models.ring_attention): SFT at CP=2 and at TP=2 x CP=2 (sequence parallel) gives the
one-GPU losses within bf16 tolerance, packed and unpacked rows; GRPO at the same layouts runs every phase,
its reward rises, its training forward's log-probs match the rollout's decode (`check_rl`:
rollout/logprob_diff_mean, the decode running with CP off), and at CP=2 (TP=1) its first step, whose rollout
is the one GPU's (same seed, same weights, a decode without CP), gives the one-GPU step's reward and, within
bf16 tolerance, its losses.

Run on a 2- or 4-GPU machine: `python -m pytest tests/gpu/test_context_parallel_gpu.py -q -s`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gpu.jobs import REL, assert_losses_match, check_rl, losses, make_assets, note, rl_job, run_job, supervised_job

torch = pytest.importorskip("torch")
GPUS = torch.cuda.device_count()
pytestmark = [pytest.mark.gpu, pytest.mark.multiproc, pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")]
four = pytest.mark.skipif(GPUS < 4, reason="needs 4 CUDA GPUs")

CP2 = {"context_parallel_size": 2}
TP2_CP2 = {"context_parallel_size": 2, "tensor_model_parallel_size": 2, "sequence_parallel": True}
FIRST_STEP = ("actor/pg_loss", "actor/kl_loss", "actor/entropy")


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    return make_assets(tmp_path_factory.mktemp("cp"))


@pytest.fixture(scope="module")
def one_gpu(assets, tmp_path_factory):
    """The one-GPU runs each case compares with, run once: SFT packed / unpacked, and GRPO."""
    runs: dict[str, list[dict]] = {}

    def rows_of(name: str) -> list[dict]:
        if name not in runs:
            tmp = tmp_path_factory.mktemp(f"one_{name}")
            cfg = rl_job(assets, "grpo", tmp / "run", 1) if name == "grpo" else _sft(assets, tmp / "run", 1, {}, name)
            runs[name] = run_job(cfg, tmp / "job.yaml")
        return runs[name]

    return rows_of


def _sft(assets, out: Path, nproc: int, megatron: dict, rows: str) -> dict:
    cfg = supervised_job(assets, "sft", out, nproc, megatron)
    cfg["data"]["packing"] = rows == "packed"
    return cfg


def _check_layout(assets, one_gpu, tmp_path: Path, nproc: int, layout: dict, label: str) -> None:
    for rows in ("packed", "unpacked"):
        got = run_job(_sft(assets, tmp_path / f"sft_{rows}", nproc, layout, rows), tmp_path / f"sft_{rows}.yaml")
        assert_losses_match(losses(got), losses(one_gpu(rows)), f"SFT {rows} {label}")
    grpo = run_job(rl_job(assets, "grpo", tmp_path / "grpo", nproc, layout), tmp_path / "grpo.yaml")
    check_rl(grpo, "grpo")
    if layout.get("tensor_model_parallel_size", 1) > 1:  # TP's decode rounds otherwise: other answers
        return
    want, got = one_gpu("grpo")[0], grpo[0]
    note(f"  GRPO {label} step 1: " + ", ".join(f"{k} {want[k]:.4f} / {got[k]:.4f}" for k in ("reward/mean", *FIRST_STEP)))
    assert got["reward/mean"] == pytest.approx(want["reward/mean"], abs=0.02), (want, got)
    for key in FIRST_STEP:
        assert got[key] == pytest.approx(want[key], rel=REL, abs=2e-3), (key, want[key], got[key])


def test_cp2_sft_and_grpo_match_one_gpu(assets, one_gpu, tmp_path):
    _check_layout(assets, one_gpu, tmp_path, 2, CP2, "CP=2")


@four
def test_tp2_cp2_sft_and_grpo_match_one_gpu(assets, one_gpu, tmp_path):
    _check_layout(assets, one_gpu, tmp_path, 4, TP2_CP2, "TP=2 x CP=2")
