"""`trinity generate`: which weights `--model` names, and answers of the rollout engine on a tiny model
(HF folder and its dist checkpoint give the same greedy answers as transformers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trinity.cli.generate import generate_answers, resolve_model
from trinity.cli.main import app
from trinity.errors import UserError


def _dist(path: Path) -> Path:
    """The files that make a folder a trinity dist checkpoint for `resolve_model` (no weights)."""
    (path / "hf").mkdir(parents=True)
    (path / "hf" / "config.json").write_text("{}")
    (path / "trinity_meta.json").write_text("{}")
    return path


def _hf(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    return path


def test_resolve_model_layouts(tmp_path):
    hf = _hf(tmp_path / "hf_model")
    assert resolve_model(hf).kind == "hf" and resolve_model(hf).weights == hf
    conv = _dist(tmp_path / "converted")
    assert (resolve_model(conv).kind, resolve_model(conv).hf_dir) == ("dist", conv / "hf")
    # an SFT run: the newest *complete* checkpoint wins over older ones, an unfinished one is skipped
    run = tmp_path / "sft_run"
    for step, done in ((2, True), (4, True), (6, False)):
        ckpt = _dist(run / "checkpoints" / f"step_{step}")
        if done:
            (ckpt / "complete").write_text("{}")
    _hf(run / "hf")
    assert resolve_model(run).weights == run / "checkpoints" / "step_4"
    # an RL checkpoint: its actor
    rl_step = tmp_path / "rl_run" / "checkpoints" / "step_3"
    _dist(rl_step / "actor")
    (rl_step / "complete").write_text("{}")
    assert resolve_model(rl_step).weights == rl_step / "actor"
    assert resolve_model(tmp_path / "rl_run").weights == rl_step / "actor"
    # a run without checkpoints: its HF export
    only_export = tmp_path / "export_run"
    _hf(only_export / "hf")
    assert resolve_model(only_export).weights == only_export / "hf"


def test_resolve_model_errors(tmp_path):
    with pytest.raises(UserError, match=r"^--model: .*nope does not exist or is not a folder$"):
        resolve_model(tmp_path / "nope")
    with pytest.raises(UserError, match=r"is neither a Hugging Face folder"):
        resolve_model(tmp_path)
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "trinity_meta.json").write_text("{}")
    with pytest.raises(UserError, match=r"dist checkpoint without hf/config.json"):
        resolve_model(tmp_path / "foreign")


def test_cli_reports_user_errors_with_exit_2(tmp_path):
    result = CliRunner().invoke(app, ["generate", "--model", str(tmp_path / "nope"), "--prompt", "hi"])
    assert result.exit_code == 2
    assert "does not exist or is not a folder" in result.output
    result = CliRunner().invoke(app, ["generate", "--model", str(tmp_path), "--prompt", "hi", "--max-new-tokens", "0"])
    assert result.exit_code == 2 and "--max-new-tokens: must be at least 1, got 0" in result.output


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from trinity.testing.tiny_assets import make_tiny_qwen2, make_tiny_tokenizer

    root = tmp_path_factory.mktemp("gen")
    tok = make_tiny_tokenizer(root / "tok")
    return make_tiny_qwen2(root / "model", tok, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)


def test_answers_equal_hf_greedy_and_dist_checkpoint(tiny, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trinity.convert.api import hf_to_mcore

    prompts = ["2+3=", "17+25="]
    ours = generate_answers(tiny, prompts, chat=True, max_new_tokens=6, device="cpu")
    tok = AutoTokenizer.from_pretrained(str(tiny))
    hf = AutoModelForCausalLM.from_pretrained(str(tiny)).eval()
    for prompt, answer in zip(prompts, ours):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:].tolist()
        if out and out[-1] == tok.eos_token_id:
            out = out[:-1]
        assert answer == tok.decode(out)
    hf_to_mcore(str(tiny), str(tmp_path / "mc"), dtype="fp32")
    assert generate_answers(tmp_path / "mc", prompts, chat=True, max_new_tokens=6, device="cpu") == ours
    # sampling is seeded: the same seed gives the same answers
    a = generate_answers(tiny, prompts, max_new_tokens=6, temperature=1.0, seed=3, device="cpu")
    assert generate_answers(tiny, prompts, max_new_tokens=6, temperature=1.0, seed=3, device="cpu") == a


def test_cli_prints_one_json_line_per_prompt(tiny):
    result = CliRunner().invoke(app, ["generate", "--model", str(tiny), "--prompt", "1+1=", "--prompt", "2+2=",
                                      "--max-new-tokens", "3", "--json", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    assert [r["prompt"] for r in rows] == ["1+1=", "2+2="] and all(isinstance(r["answer"], str) for r in rows)
