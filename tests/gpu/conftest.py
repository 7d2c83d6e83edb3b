"""Shared set-up of the GPU tests: a small random Qwen2 (8 layers, hidden 1024) saved as an HF folder,
with megatron-core initialised on one CUDA device (TP=PP=1) for the module's tests."""

from __future__ import annotations

import os


def _pin_lane() -> None:
    """`TRINITY_GPU_LANES="0,1;2,3"` with `pytest -n 2`: xdist worker gwN sees only lane N's GPUs, so two
    2-GPU jobs run side by side on a 4-GPU machine. Set before torch first looks at CUDA."""
    lanes = [lane for lane in os.environ.get("TRINITY_GPU_LANES", "").split(";") if lane]
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if lanes and worker.startswith("gw"):
        os.environ["CUDA_VISIBLE_DEVICES"] = lanes[int(worker[2:]) % len(lanes)]


_pin_lane()

import pytest  # noqa: E402
import torch  # noqa: E402

# TRINITY_GPU_LOG=<file>: each test's outcome, duration and (on failure) report, appended as it ends, and
# whatever the tests `note()` (tests/gpu/jobs.py): a device call cut off at its time limit still says
# what ran. Written by the controller only (xdist workers relay their reports to it).
GPU_LOG = os.environ.get("TRINITY_GPU_LOG")


def pytest_runtest_logreport(report):
    if not GPU_LOG or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if report.when == "call" or report.outcome == "failed":
        with open(GPU_LOG, "a") as f:
            f.write(f"{report.outcome.upper()} {report.nodeid} ({report.when}, {report.duration:.0f} s)\n")
            if report.failed:
                f.write(str(report.longrepr)[-3000:] + "\n")


@pytest.fixture(scope="module")
def qwen2_small_cuda(tmp_path_factory):
    """(ModelFacts, HF folder) of the small Qwen2; megatron's parallel state is up for the module."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trinity.distributed.layout import ParallelLayout
    from trinity.distributed.parallel import destroy, init_parallel
    from trinity.models.facts import ModelFacts

    path = tmp_path_factory.mktemp("qwen2_small")
    cfg = Qwen2Config(num_hidden_layers=8, hidden_size=1024, intermediate_size=2816, num_attention_heads=16,
                      num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(str(path), safe_serialization=True)
    init_parallel(device="cuda", layout=ParallelLayout(), seed=1)
    yield ModelFacts.from_hf_dir(path), path
    destroy()
