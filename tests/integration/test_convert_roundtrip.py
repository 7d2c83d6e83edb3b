"""HF -> megatron-core -> HF on tiny models of every family (CPU, fp32, world size 1)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from trinity.convert import jobs, mbridge_adapter
from trinity.convert.api import hf_to_mcore, mcore_to_hf
from trinity.convert.options import megatron_config
from trinity.convert.builtin import export_hf_weights, load_hf_weights
from trinity.convert.dist_ckpt import read_meta
from trinity.convert.hf_io import HF_SIDE_FILES
from trinity.convert.jobs import _build, _holder, parallel_session
from trinity.convert.verify import compare_folders, hf_logits, mcore_logits, random_tokens
from trinity.errors import UserError
from trinity.models.facts import ModelFacts
from trinity.testing.tiny_assets import make_tiny_tokenizer
from trinity.testing.tiny_models import make_tiny_hf_model

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)

CASES = [  # family, tied embeddings (all tiny models are GQA: 4 heads, 2 KV heads)
    ("llama", True),
    ("qwen2", False),
    ("qwen2", True),
    ("qwen3", False),
    ("qwen3_moe", False),
    ("mixtral", True),
    ("gemma2", True),
    ("gemma3", True),
    ("mistral", False),  # sliding window
    ("phi3", True),  # fused qkv_proj / gate_up_proj, partial rotary, sliding window
    ("qwen2_moe", False),  # gated shared expert, norm_topk_prob False
    ("glm4", False),  # interleaved partial rotary, fused gate_up_proj, post-block norms
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
    # Side files: a tokenizer and a generation config of our own must reach <mcore>/hf/ and the export.
    make_tiny_tokenizer(src)
    generation = {"bos_token_id": 0, "eos_token_id": 0, "do_sample": True, "temperature": 0.7, "top_p": 0.8}
    (src / "generation_config.json").write_text(json.dumps(generation))
    side = sorted(n for n in HF_SIDE_FILES if (src / n).is_file() and n != "config.json")
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(side)
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
    for name in side:
        for where in (tmp_path / "mc" / "hf", tmp_path / "back"):
            assert (where / name).read_bytes() == (src / name).read_bytes(), f"{where / name}"
    from transformers import AutoTokenizer, GenerationConfig

    text = "12+7=19 <|im_end|>"
    assert AutoTokenizer.from_pretrained(str(tmp_path / "back"))(text)["input_ids"] == AutoTokenizer.from_pretrained(str(src))(text)["input_ids"]
    assert GenerationConfig.from_pretrained(str(tmp_path / "back")).temperature == 0.7
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


# --- direct reads (preadv into the parameters) and the read-fuse-copy path agree -----------------------


def _counting(monkeypatch):
    """Count HFCheckpoint.get (whole tensors: the fallback) and read_rows_into (the direct path)."""
    from trinity.convert.hf_io import HFCheckpoint

    calls = {"get": 0, "read_rows_into": 0}
    for name in calls:
        real = getattr(HFCheckpoint, name)

        def counted(self, *args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(HFCheckpoint, name, counted)
    return calls


def _as_dtype(src: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    sd = {k: v.to(dtype) for k, v in _source(src).items()}
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    return sd


def test_bf16_checkpoint_is_read_straight_into_bf16_parameters(tmp_path, monkeypatch):
    src = make_tiny_hf_model("qwen3_moe", tmp_path / "hf")
    original = _as_dtype(src, torch.bfloat16)
    facts = ModelFacts.from_hf_dir(src)
    calls = _counting(monkeypatch)
    with parallel_session("cpu", megatron_config()):
        models = _holder(facts, megatron_config(), torch.bfloat16)  # what hf_to_mcore fills
        assert all(p.dtype == torch.bfloat16 for p in models[0].parameters())
        for p in models[0].parameters():
            p.data.fill_(float("nan"))  # a row the direct path missed would stay NaN
        load_hf_weights(models, src, facts)
        exported = dict(export_hf_weights(models, facts))
    assert calls["get"] == 0 and calls["read_rows_into"] >= len(original)
    for name, t in original.items():
        assert torch.equal(exported[name], t), name


def test_fp32_checkpoint_into_bf16_parameters_casts_through_the_fallback(tmp_path, monkeypatch):
    src = make_tiny_hf_model("qwen2", tmp_path / "hf")
    original = _source(src)
    facts = ModelFacts.from_hf_dir(src)
    calls = _counting(monkeypatch)
    with parallel_session("cpu", megatron_config()):
        models = _holder(facts, megatron_config(), torch.bfloat16)
        load_hf_weights(models, src, facts)
        exported = dict(export_hf_weights(models, facts))
    assert calls["read_rows_into"] == 0 and calls["get"] == len(original)
    for name, t in original.items():
        assert torch.equal(exported[name], t.to(torch.bfloat16)), name


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_direct_reads_give_every_tp_rank_its_tp_split(tmp_path, monkeypatch, family):
    """Every rule at TP=2, each rank's parameter filled by _load_one against tp_split(to_mcore(...))."""
    from trinity.convert.builtin import _Entry, _geometry, _load_one, _Ranks
    from trinity.convert.hf_io import HFCheckpoint
    from trinity.convert.registry import weight_map
    from trinity.convert.weightmap import to_mcore, tp_split

    src = make_tiny_hf_model(family, tmp_path / "hf")
    sd = _as_dtype(src, torch.bfloat16)
    facts = ModelFacts.from_hf_dir(src)
    ckpt = HFCheckpoint(src)
    calls = _counting(monkeypatch)
    size, direct = 2, 0
    for rule in weight_map(family).rules:
        experts = list(range(facts.num_experts or 0)) if rule.grouped else ([1] if "{E}" in rule.mcore else None)
        names = rule.hf_names(0, experts)
        if not all(n in sd for n in names):
            continue
        n_exp = len(experts) if rule.grouped else 1
        padded = -(-facts.vocab_size // (64 * size)) * 64 * size  # rows past the vocabulary on the last rank
        geo = _geometry(facts, padded)
        full = to_mcore(rule, [sd[n] for n in names], geo)
        for rank in range(size):
            expect = tp_split(rule, full, rank, size, n_exp)
            param = torch.full_like(expect, float("nan"))
            before = calls["read_rows_into"]
            _load_one(_Entry(rule, param, 0, experts), ckpt, facts, _Ranks(tp=rank, tp_size=size, etp=rank, etp_size=size))
            assert torch.equal(param, expect), (rule.mcore, rank)
            direct += calls["read_rows_into"] > before
            # Row-parallel and grouped weights are not whole HF rows: they take the fallback.
            assert (calls["read_rows_into"] > before) == (rule.tp_dim != 1 and not rule.grouped), rule.mcore
    ckpt.close()
    assert direct >= 8


# --- failure modes: one clear message naming the file/tensor, and no output folder ------------------


def _no_output(tmp_path: Path) -> None:
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_unsupported_architecture(tmp_path):
    src = make_tiny_hf_model("qwen2", tmp_path / "hf")
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=r"config.json: architecture .GPT2LMHeadModel. is not supported; supported: .*LlamaForCausalLM"):
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


# --- a failed --verify leaves no output ------------------------------------------------------------


def test_failed_verify_removes_hf_to_mcore_output(tmp_path, monkeypatch):
    src = make_tiny_hf_model("qwen2", tmp_path / "hf")
    real = jobs.load_hf_weights

    def broken(models, *args, **kwargs):  # a converter bug: one tensor off after loading
        real(models, *args, **kwargs)
        with torch.no_grad():
            dict(models[0].named_parameters())["decoder.final_layernorm.weight"].add_(0.5)

    monkeypatch.setattr(jobs, "load_hf_weights", broken)
    with pytest.raises(UserError, match=r"verification failed, max \|Δlogits\|.*out was removed\)"):
        hf_to_mcore(str(src), str(tmp_path / "out"), dtype="fp32", verify=True)
    _no_output(tmp_path)


def test_failed_verify_removes_mcore_to_hf_output(tmp_path, monkeypatch):
    src = make_tiny_hf_model("qwen2", tmp_path / "hf")
    hf_to_mcore(str(src), str(tmp_path / "mc"), dtype="fp32")
    real = jobs.write_shards

    def broken(tensors, *args, **kwargs):  # a writer bug: one tensor off on disk
        return real(((n, t + 1 if n == "model.norm.weight" else t) for n, t in tensors), *args, **kwargs)

    monkeypatch.setattr(jobs, "write_shards", broken)
    with pytest.raises(UserError, match=r"tensor 'model.norm.weight' differs.*out was removed\)"):
        mcore_to_hf(str(tmp_path / "mc"), str(tmp_path / "out"), verify=True)
    _no_output(tmp_path)
    assert (tmp_path / "mc" / "trinity_meta.json").is_file()  # the source checkpoint is untouched


# --- flags megatron-core cannot build: a UserError naming the flag, before anything is written ----------


@pytest.mark.parametrize(
    "family,kwargs,message",
    [
        ("qwen2", dict(vpp=2), r"--vpp: needs --pp > 1"),
        ("qwen2", dict(pp=2, vpp=2), r"--vpp: 2 layers are not divisible by PP x VPP = 2 x 2"),
        ("qwen2", dict(pp=3), r"--pp: 2 layers are not divisible by PP=3"),
        ("qwen2", dict(ep=2), r"--ep: EP=2 needs an MoE model, but Qwen2ForCausalLM is dense"),
        ("qwen2", dict(tp=4), r"--tp: 2 key/value heads are not divisible by TP=4"),
        ("qwen2", dict(tp=3), r"--tp: 4 attention heads are not divisible by TP=3"),
        ("qwen2", dict(tp=0), r"--tp: must be at least 1"),
        ("qwen3_moe", dict(ep=3), r"--ep: 4 experts are not divisible by EP=3"),
    ],
)
def test_invalid_layout_flags_are_user_errors(tmp_path, family, kwargs, message):
    src = make_tiny_hf_model(family, tmp_path / "hf")
    with pytest.raises(UserError, match=message):
        hf_to_mcore(str(src), str(tmp_path / "out"), dtype="fp32", device="cpu", **kwargs)
    _no_output(tmp_path)


def test_more_ranks_than_gpus_is_a_user_error(tmp_path, monkeypatch):
    src = make_tiny_hf_model("qwen2", tmp_path / "hf")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UserError, match=r"--tp/--pp/--ep: TP x PP x EP = 2 x 1 x 1 = 2 processes need 2 GPUs, this machine has 1"):
        hf_to_mcore(str(src), str(tmp_path / "out"), tp=2, device="cuda")
    _no_output(tmp_path)


# --- the mbridge backend is as strict as the builtin one ---------------------------------------------


def test_mbridge_backend_refuses_unmapped_tensor(tmp_path):
    src = make_tiny_hf_model("qwen2", tmp_path / "hf")
    sd = _source(src)
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.randn(8)
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"model.safetensors: tensor 'model.layers.0.self_attn.rotary_emb.inv_freq' is not in the weight map"):
        hf_to_mcore(str(src), str(tmp_path / "out"), dtype="fp32", backend="mbridge")
    _no_output(tmp_path)


# --- a conversion killed with SIGKILL leaves a temporary sibling; the next one removes it ------------

_KILLED = """
import os, signal, sys


def main():
    from megatron.core import dist_checkpointing

    real = dist_checkpointing.save

    def save(state, path, *args, **kwargs):
        real(state, path, *args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)  # after the shards are written, before the rename

    dist_checkpointing.save = save
    from trinity.convert.api import hf_to_mcore

    hf_to_mcore(sys.argv[1], sys.argv[2], dtype="fp32", device="cpu")


if __name__ == "__main__":  # the dist-checkpoint writer's helper processes re-import __main__
    main()
"""


def test_killed_conversion_leftovers_are_removed_by_the_next_one(tmp_path):
    src = make_tiny_hf_model("qwen2", tmp_path / "hf")
    script = tmp_path / "killed.py"
    script.write_text(_KILLED)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    with open(tmp_path / "log.txt", "w") as log:
        # Its own session: the writer's helper processes outlive a SIGKILLed parent; ended below by group.
        proc = subprocess.Popen([sys.executable, str(script), str(src), str(tmp_path / "out")], env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=150)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert code == -signal.SIGKILL, (tmp_path / "log.txt").read_text()[-3000:]
    (tmp_path / "log.txt").unlink()
    script.unlink()
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]
    assert len(left) == 1 and any(left[0].iterdir()) and not (tmp_path / "out").exists()
    assert left[0].name.split("-")[-2] == str(proc.pid)  # the name records the dead process
    hf_to_mcore(str(src), str(tmp_path / "out"), dtype="fp32", device="cpu")
    assert not left[0].exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "out"]
    assert read_meta(tmp_path / "out")["dtype"] == "float32"
