"""Two gloo ranks: TP=2 and PP=2 layouts load HF weights, give the HF logits, export bit-exactly, and
a dist checkpoint saved at TP=2 loads at PP=2; EP=2 does the same for an MoE model. Also
`hf_to_mcore(tp=2)` through torchrun (rank 0's output reaches the caller, the other ranks' is kept
for the error message).

This file is also the torchrun script (`python -m torch.distributed.run ... <this file> HF OUT [ep2]`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _logits(models, tokens, vocab):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from trinity.convert.verify import causal_mask

    model = models[0]
    b, s = tokens.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = causal_mask(s)
    with torch.no_grad():
        if ps.get_pipeline_model_parallel_world_size() > 1:
            h = torch.empty(s, b, model.config.hidden_size)
            if not ps.is_pipeline_first_stage():
                dist.recv(h, src=ps.get_pipeline_model_parallel_prev_rank())
                model.set_input_tensor(h)
            out = model(tokens, pos, mask, runtime_gather_output=True)
            if not ps.is_pipeline_last_stage():
                dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
                out = torch.empty(b, s, vocab)
            else:
                out = out[..., :vocab].contiguous()
            dist.broadcast(out, src=dist.get_world_size() - 1)
            return out
        return model(tokens, pos, mask, runtime_gather_output=True)[..., :vocab]


def _job(hf_dir: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from trinity.convert.options import megatron_config
    from trinity.convert.builtin import export_hf_weights, load_hf_weights
    from trinity.convert.dist_ckpt import load_model_checkpoint, save_model_checkpoint
    from trinity.convert.jobs import _build
    from trinity.distributed.parallel import destroy, init_parallel
    from trinity.convert.verify import random_tokens
    from trinity.models.facts import ModelFacts

    facts = ModelFacts.from_hf_dir(hf_dir)
    tokens = random_tokens(facts.vocab_size)
    source = load_file(str(Path(hf_dir) / "model.safetensors"))
    result: dict[str, object] = {}
    ckpt = str(Path(out) / "ckpt_tp2")
    for name, kw in [("tp2", dict(tp=2)), ("pp2", dict(pp=2))]:
        megatron = megatron_config(**kw)
        # One process group for both layouts (re-creating it under torchrun's store is not supported).
        init_parallel(device="cpu", layout=megatron.layout(), seed=0)
        models = _build(facts, megatron, "cpu", torch.float32)
        load_hf_weights(models, hf_dir, facts)
        logits = _logits(models, tokens, facts.vocab_size)
        exported = dict(export_hf_weights(models, facts))
        result[f"{name}_export_exact"] = set(exported) == set(source) and all(
            torch.equal(exported[k], v) for k, v in source.items()
        )
        if name == "tp2":
            save_model_checkpoint(models, ckpt, hf_dir=hf_dir)
        else:
            fresh = _build(facts, megatron, "cpu", torch.float32)
            load_model_checkpoint(fresh, ckpt)
            result["tp2_ckpt_at_pp2_max_diff"] = float((_logits(fresh, tokens, facts.vocab_size) - logits).abs().max())
        if dist.get_rank() == 0:
            torch.save(logits, Path(out) / f"{name}.pt")
    destroy()
    if int(os.environ["RANK"]) == 0:
        (Path(out) / "result.json").write_text(json.dumps(result))


def _job_ep2(hf_dir: str, out: str) -> None:
    """EP=2 (so DP=2): each rank holds half the experts and computes the logits with tokens crossing ranks."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from trinity.convert.options import megatron_config
    from trinity.convert.builtin import export_hf_weights, load_hf_weights
    from trinity.convert.jobs import _build
    from trinity.convert.verify import random_tokens
    from trinity.distributed.parallel import destroy, init_parallel
    from trinity.models.facts import ModelFacts

    facts = ModelFacts.from_hf_dir(hf_dir)
    tokens = random_tokens(facts.vocab_size)
    source = load_file(str(Path(hf_dir) / "model.safetensors"))
    megatron = megatron_config(ep=2)
    # The alltoall dispatcher hands torch.distributed split sizes as tensors, which gloo refuses (a
    # CPU-only gap of megatron-core 0.16.1); allgather dispatches the same tokens to the same experts.
    megatron.moe_token_dispatcher_type = "allgather"
    init_parallel(device="cpu", layout=megatron.layout(), seed=0)
    models = _build(facts, megatron, "cpu", torch.float32)
    load_hf_weights(models, hf_dir, facts)
    local_experts = sorted({n.split("local_experts.")[1].split(".")[0] for n, _ in models[0].named_parameters()
                            if "local_experts." in n})
    logits = _logits(models, tokens, facts.vocab_size)
    exported = dict(export_hf_weights(models, facts))
    result = {
        "local_experts": len(local_experts),
        "export_exact": set(exported) == set(source) and all(torch.equal(exported[k], v) for k, v in source.items()),
    }
    torch.save(logits, Path(out) / f"ep2_rank{dist.get_rank()}.pt")
    destroy()
    if int(os.environ["RANK"]) == 0:
        (Path(out) / "result.json").write_text(json.dumps(result))


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(240)
# Gemma's options over TP and over PP stages: gemma2 (4 layers, a sliding and a global one per stage,
# capped scores and logits), gemma3 (6 layers, 3 per stage: per-layer specs from the stage's layer offset,
# the global layer with its scaled RoPE on stage 1; a capped final logit)
@pytest.mark.parametrize("family,shape", [
    ("qwen2", {}), ("gemma2", {"num_hidden_layers": 4}), ("gemma3", {"final_logit_softcapping": 3.0}),
])
def test_tp2_and_pp2_layouts_match_hf(tmp_path, family, shape):
    import torch

    from trinity.convert.verify import hf_logits, random_tokens
    from trinity.testing.tiny_models import make_tiny_hf_model

    # Untied: build_model with PP=2 and tied embeddings calls .cuda() in megatron (cpu_compat gap).
    src = make_tiny_hf_model(family, tmp_path / "hf", **shape)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           __file__, str(src), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["tp2_export_exact"] and result["pp2_export_exact"]
    assert result["tp2_ckpt_at_pp2_max_diff"] <= 1e-5
    theirs = hf_logits(src, random_tokens(128))
    for name in ("tp2", "pp2"):
        ours = torch.load(tmp_path / f"{name}.pt")
        assert (ours - theirs).abs().max() <= 1e-5, name


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ep2_moe_layout_matches_hf(tmp_path):
    import torch

    from trinity.convert.verify import hf_logits, random_tokens
    from trinity.testing.tiny_models import make_tiny_hf_model

    src = make_tiny_hf_model("qwen3_moe", tmp_path / "hf")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           __file__, str(src), str(tmp_path), "ep2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["local_experts"] == 2  # 4 experts over EP=2
    assert result["export_exact"]
    theirs = hf_logits(src, random_tokens(128))
    for rank in (0, 1):
        ours = torch.load(tmp_path / f"ep2_rank{rank}.pt")
        assert (ours - theirs).abs().max() <= 1e-5, rank


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cli_api_tp2_writes_per_rank_shards(tmp_path, capfd):
    from trinity.convert.api import hf_to_mcore, mcore_to_hf
    from trinity.convert.verify import compare_folders
    from trinity.testing.tiny_models import make_tiny_hf_model

    src = make_tiny_hf_model("qwen3_moe", tmp_path / "hf")
    capfd.readouterr()
    report = hf_to_mcore(str(src), str(tmp_path / "mc"), tp=2, dtype="fp32", verify=True)
    assert report.max_abs_diff <= 1e-4
    # Rank 0 writes straight to our stdout (the user's terminal); rank 1 goes to a log file.
    out = capfd.readouterr().out
    assert "rank 0 of 2: converting" in out and "TP=2" in out
    assert "rank 1" not in out
    assert len(list((tmp_path / "mc").glob("__*_*.distcp"))) >= 2  # each rank wrote its own files
    mcore_to_hf(str(tmp_path / "mc"), str(tmp_path / "back"))
    compare_folders(tmp_path / "back", src, what="tp2 round trip")


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_failed_torchrun_job_quotes_the_other_ranks_logs(tmp_path):
    from trinity.convert.api import conversion_job

    # Arguments the worker cannot take: every rank dies with a TypeError (an internal error).
    with pytest.raises(RuntimeError, match=r"(?s)conversion job failed.*--- rank 1 stderr ---.*TypeError.*bogus"):
        conversion_job(2, {"bogus": 1, "output": str(tmp_path / "out")})


if __name__ == "__main__":  # torchrun entry; the dist-checkpoint writer re-imports __main__
    if sys.argv[3:] == ["ep2"]:
        _job_ep2(sys.argv[1], sys.argv[2])
    else:
        _job(sys.argv[1], sys.argv[2])
