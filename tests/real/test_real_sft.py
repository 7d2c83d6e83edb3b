"""SFT of the real model on chat records (configs/smollm2_sft_cpu.yaml): the training loss falls, and the
exported HF model and the run's last checkpoint (through `trinity generate`) both answer with the
made-up fact it was taught, which the base model does not know."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import trinity_run

pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
QUESTION = "What is the Trinity mascot?"


def _hf_answer(model_dir: Path, question: str) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=20, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_sft_teaches_a_fact(real_assets, tmp_path):
    from trinity.testing.real_model import FACT_QUESTIONS

    assert QUESTION in FACT_QUESTIONS
    before = _hf_answer(real_assets / "model", QUESTION)
    assert "Pim" not in before, before

    cfg = yaml.safe_load((REPO / "configs" / "smollm2_sft_cpu.yaml").read_text())
    cfg["model"]["path"] = str(real_assets / "model")
    cfg["data"]["train_files"] = [str(real_assets / "data" / "sft_chat.jsonl")]
    # 5 of the config's 8 steps: the loss is down ~300x by then (1.90 -> 0.006 measured), and CI time counts
    cfg["trainer"].update(output_dir=str(tmp_path / "run"), total_steps=5)
    proc = trinity_run(cfg, tmp_path / "sft.yaml", timeout=800, reuse_conversion=True)
    assert proc.returncode == 0, proc.stdout[-3000:]

    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows]
    assert len(losses) == cfg["trainer"]["total_steps"]
    # the loss is on assistant turns only; by the end the taught answers are nearly memorised
    assert sum(losses[-3:]) / 3 < 0.3 * losses[0], losses

    after = _hf_answer(tmp_path / "run" / "hf", QUESTION)
    assert "Pim" in after and "otter" in after, after

    # `trinity generate` on the run folder loads its last training checkpoint (dist checkpoint)
    gen = subprocess.run(
        [sys.executable, "-m", "trinity.cli.main", "generate", "--model", str(tmp_path / "run"), "--chat",
         "--max-new-tokens", "20", "--prompt", QUESTION],
        capture_output=True, text=True, timeout=300,
    )
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert gen.stdout.strip() == after.strip(), (gen.stdout, after)
