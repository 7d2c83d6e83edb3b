"""DeepSeek-V3 (MLA, a dense layer then an MoE layer with a shared expert, sigmoid routing with its
score bias) through `trinity run` on CPU: an SFT job (packed rows) learns (its loss falls), saves its
checkpoint and exports the HF checkpoint with the source's tensor names (the frozen router bias unchanged).
RL's pieces (one-row packed micro batches, the rollout decoders) are checked in process in
tests/unit/test_deepseek.py; a GRPO job runs as any other family's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import trinity_run


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoTokenizer

    from trinity.testing.tiny_assets import make_tiny_tokenizer, write_sft_dataset
    from trinity.testing.tiny_models import make_tiny_hf_model

    root = tmp_path_factory.mktemp("deepseek_run")
    tok = AutoTokenizer.from_pretrained(str(make_tiny_tokenizer(root / "tokenizer")))
    model = make_tiny_hf_model("deepseek_v3", root / "model", vocab_size=-(-len(tok) // 64) * 64,
                               bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id)
    tok.save_pretrained(str(model))
    return {"model": model, "sft": write_sft_dataset(root / "sft.jsonl", 64, seed=0)}


def _trainer(out: Path, **extra) -> dict:
    return {"output_dir": str(out), "save_interval": None, "log_interval": 1, "tensorboard": False,
            "export_hf": True, **extra}


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _exported(out: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted((out / "hf").glob("*.safetensors")):
        weights.update(load_file(str(shard)))
    return weights


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sft_learns_and_exports(assets, tmp_path):
    base = load_file(str(assets["model"] / "model.safetensors"))
    optim = {"lr": 3e-3, "lr_warmup_steps": 1, "lr_scheduler": "constant", "weight_decay": 0.0, "clip_grad": 1.0}
    sft = {
        "algorithm": {"name": "sft"},
        "model": {"path": str(assets["model"])},
        "data": {"train_files": [str(assets["sft"])], "seq_length": 64, "packing": True},
        "cluster": {"device": "cpu", "nproc_per_node": 1},
        "trainer": _trainer(tmp_path / "sft", total_steps=6, global_batch_size=8, micro_batch_size=4),
        "actor_rollout_ref": {"actor": {"optim": optim}},
    }
    proc = trinity_run(sft, tmp_path / "sft.yaml", timeout=300, reuse_conversion=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    losses = [row["loss"] for row in _metrics(tmp_path / "sft")]
    assert len(losses) == 6 and losses[-1] < 0.8 * losses[0], losses
    weights = _exported(tmp_path / "sft")
    assert sorted(weights) == sorted(base)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert torch.equal(weights[bias], base[bias])
    assert not torch.equal(weights["model.layers.1.self_attn.kv_b_proj.weight"], base["model.layers.1.self_attn.kv_b_proj.weight"])

