"""HF -> megatron-core -> HF on tiny models of every family (CPU, fp32, world size 1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from trinity.convert import mbridge_adapter
from trinity.convert.api import hf_to_mcore, megatron_config, mcore_to_hf
from trinity.convert.builtin import export_hf_weights, load_hf_weights
from trinity.convert.dist_ckpt import read_meta
from trinity.convert.jobs import _build, parallel_session
from trinity.convert.verify import compare_folders, hf_logits, mcore_logits, random_tokens
from trinity.errors import UserError
from trinity.models.facts import ModelFacts
from trinity.testing.tiny_models import make_tiny_hf_model

pytestmark = pytest.mark.timeout(120)

CASES = [  # family, tied embeddings (all tiny models are GQA: 4 heads, 2 KV heads)
    ("llama", True),
    ("qwen2", False),
    ("qwen2", True),
    ("qwen3", False),
    ("qwen3_moe", False),
    ("mixtral", True),
]


def _source(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("family,tied", CASES)
def test_load_logits_and_export_bit_exact(tmp_path, family, tied):
    src = make_tiny_hf_model(family, tmp_path / "hf", tie_word_embeddings=tied)
    facts = ModelFacts.from_hf_dir(src)
    tokens = random_tokens(facts.vocab_size)
    megatron = megatron_config()
    with parallel_session("cpu", megatron):
        models = _build(facts, megatron, "cpu", torch.float32)
        load_hf_weights(models, src, facts)
        ours = mcore_logits(models[0], tokens, facts.vocab_size)
        exported = dict(export_hf_weights(models, facts))
    theirs = hf_logits(src, tokens)
    assert (ours - theirs).abs().max() <= 1e-5
    original = _source(src)
    assert set(exported) == set(original)
    for name, t in original.items():
        assert torch.equal(exported[name], t), name


def test_api_round_trip_with_verify(tmp_path):
    src = make_tiny_hf_model("qwen2", tmp_path / "hf")
    report = hf_to_mcore(str(src), str(tmp_path / "mc"), dtype="fp32", verify=True)
    assert report.max_abs_diff is not None and report.max_abs_diff <= 1e-4
    meta = read_meta(tmp_path / "mc")
    assert meta["architecture"] == "Qwen2ForCausalLM" and meta["dtype"] == "float32"
    assert meta["layout"] == {"tp": 1, "pp": 1, "vpp": None, "ep": 1}
    assert (tmp_path / "mc" / "hf" / "config.json").is_file()
    back = mcore_to_hf(str(tmp_path / "mc"), str(tmp_path / "back"), verify=True)
    assert "bit for bit" in (back.verified or "")
    compare_folders(tmp_path / "back", src, what="round trip")
    assert (tmp_path / "back" / "model.safetensors.index.json").is_file()
    # transformers reads the export back
    tokens = random_tokens(128)
    assert torch.equal(hf_logits(tmp_path / "back", tokens), hf_logits(src, tokens))


def test_bf16_conversion_keeps_logits_and_reexports_exactly(tmp_path):
    src = make_tiny_hf_model("qwen3", tmp_path / "hf")
    report = hf_to_mcore(str(src), str(tmp_path / "mc"), dtype="bf16", verify=True)
    assert read_meta(tmp_path / "mc")["dtype"] == "bfloat16" and report.max_abs_diff <= 1e-4
    back = mcore_to_hf(str(tmp_path / "mc"), str(tmp_path / "back"), verify=True)
    assert load_file(str(tmp_path / "back" / "model-00001-of-00001.safetensors"))["model.norm.weight"].dtype == torch.bfloat16
    assert back.max_abs_diff == 0.0
    fp32 = mcore_to_hf(str(tmp_path / "mc"), str(tmp_path / "fp32"), dtype="fp32", verify=True)
    assert "logits" in fp32.verified and fp32.max_abs_diff <= 1e-4


def test_mbridge_and_builtin_give_identical_checkpoints(tmp_path):
    src = make_tiny_hf_model("qwen2", tmp_path / "hf")
    hf_to_mcore(str(src), str(tmp_path / "builtin"), dtype="fp32")
    hf_to_mcore(str(src), str(tmp_path / "mbridge"), dtype="fp32", backend="mbridge")
    mcore_to_hf(str(tmp_path / "builtin"), str(tmp_path / "b_hf"))
    mcore_to_hf(str(tmp_path / "mbridge"), str(tmp_path / "m_hf"))
    compare_folders(tmp_path / "m_hf", tmp_path / "b_hf", what="mbridge vs builtin")
    facts = ModelFacts.from_hf_dir(src)
    megatron = megatron_config()
    with parallel_session("cpu", megatron):
        models = _build(facts, megatron, "cpu", torch.float32)
        mbridge_adapter.load_weights(models, src, facts)
        exported = dict(mbridge_adapter.export_weights(models, src, facts))
    for name, t in _source(src).items():
        assert torch.equal(exported[name], t), name


# --- failure modes: one clear message naming the file/tensor, and no output folder ------------------


def _no_output(tmp_path: Path) -> None:
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_unsupported_architecture(tmp_path):
    src = make_tiny_hf_model("qwen2", tmp_path / "hf")
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=r"config.json: architecture 'GPT2LMHeadModel' is not supported; supported: Llama"):
        hf_to_mcore(str(src), str(tmp_path / "out"))
    _no_output(tmp_path)


def test_shape_mismatch_names_tensor_and_file(tmp_path):
    src = make_tiny_hf_model("qwen2", tmp_path / "hf")
    sd = _source(src)
    sd["model.layers.1.mlp.down_proj.weight"] = torch.randn(64, 96)
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"decoder.layers.1.mlp.linear_fc2.weight.*model.layers.1.mlp.down_proj.weight \[64, 96\] in model.safetensors"):
        hf_to_mcore(str(src), str(tmp_path / "out"), dtype="fp32")
    _no_output(tmp_path)


def test_unmapped_tensor_names_tensor_and_file(tmp_path):
    src = make_tiny_hf_model("llama", tmp_path / "hf")
    sd = _source(src)
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.randn(8)
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"model.safetensors: tensor 'model.layers.0.self_attn.rotary_emb.inv_freq' is not in the weight map"):
        hf_to_mcore(str(src), str(tmp_path / "out"), dtype="fp32")
    _no_output(tmp_path)


def test_missing_tensor_names_tensor(tmp_path):
    src = make_tiny_hf_model("qwen3", tmp_path / "hf")
    sd = _source(src)
    del sd["model.layers.1.self_attn.k_norm.weight"]
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"tensor 'model.layers.1.self_attn.k_norm.weight' is missing"):
        hf_to_mcore(str(src), str(tmp_path / "out"), dtype="fp32")
    _no_output(tmp_path)


def test_truncated_shard_and_existing_output(tmp_path):
    src = make_tiny_hf_model("qwen2", tmp_path / "hf")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("keep")
    with pytest.raises(UserError, match="output folder exists and is not empty"):
        hf_to_mcore(str(src), str(tmp_path / "out"))
    assert (tmp_path / "out" / "x").read_text() == "keep"
    (tmp_path / "out" / "x").unlink()
    (tmp_path / "out").rmdir()
    shard = src / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(UserError, match=r"model.safetensors: corrupt or truncated weight shard"):
        hf_to_mcore(str(src), str(tmp_path / "out"))
    _no_output(tmp_path)


def test_mcore_to_hf_needs_a_trinity_checkpoint(tmp_path):
    (tmp_path / "ck").mkdir()
    with pytest.raises(UserError, match=r"ck/trinity_meta.json: not a trinity dist checkpoint"):
        mcore_to_hf(str(tmp_path / "ck"), str(tmp_path / "out"))
    _no_output(tmp_path)
