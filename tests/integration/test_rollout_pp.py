"""Rollout at PP=2 (2 processes, gloo, fp32) against PP=1 through the real megatron model: each stage runs
its own layers and KV cache, hidden states go stage to stage, the last stage samples and broadcasts.
Forward-only log-probs (old / ref) through the pipeline schedule match the rollout's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.conftest import run_two_ranks

PROMPTS = [[5, 9, 17, 3, 44, 2], [7, 1], [100, 12, 8, 60], [33, 34]]


def _build(facts, path, pp: int, device: str):
    from trinity.config.megatron import MegatronConfig
    from trinity.convert.builtin import load_hf_weights
    from trinity.distributed.parallel import init_parallel
    from trinity.models.build import build_model

    m = MegatronConfig(pipeline_model_parallel_size=pp)
    init_parallel(device=device, layout=m.layout(), seed=3)
    (model,) = build_model(facts, m, device=device, dtype=torch.float32)
    load_hf_weights([model], path, facts)
    return model


def _rollouts(model, facts, pp: int) -> dict:
    from trinity.rollout.reference import reference_generate
    from trinity.rollout.types import SamplingParams

    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    hot = SamplingParams(temperature=1.0, top_k=50, max_new_tokens=10, eos_token_ids=tuple(range(1, 40)))
    kw = dict(vocab_size=facts.vocab_size, pad_id=0)
    out = {"greedy": reference_generate(model, PROMPTS, greedy, **kw)}
    if pp == 1:  # the reference sample: seed 1
        out["sampled"] = reference_generate(model, PROMPTS * 2, hot, generator=torch.Generator().manual_seed(1), **kw)
    else:  # each rank passes its own seed: only the last stage (rank 1) samples, so seed 1 must win
        seed = torch.distributed.get_rank()
        out["sampled"] = reference_generate(model, PROMPTS * 2, hot, generator=torch.Generator().manual_seed(seed), **kw)
        out["greedy_nocache"] = reference_generate(model, PROMPTS, greedy, use_cache=False, **kw)
        out["greedy_eager"] = reference_generate(model, PROMPTS, greedy, cuda_graphs=False, **kw)  # CUDA graphs off (GPU)
    return out


def _worker(rank: int, port: int, model_dir: str, out: str, device: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from trinity.distributed.parallel import destroy
    from trinity.models.facts import ModelFacts
    from trinity.trainer.recipes.rollout_forward import infer_logprobs

    facts = ModelFacts.from_hf_dir(model_dir)
    try:
        pp2 = _build(facts, model_dir, 2, device)
        stage_layers = len(pp2.decoder.layers)
        got = _rollouts(pp2, facts, 2)
        # old / ref log-probs through the pipeline schedule (micro batches 3, 3, 2), on every stage
        infer_diff = (infer_logprobs([pp2], got["sampled"], facts.vocab_size, 3) - got["sampled"].logprobs).abs().max().item()
        gathered = [None, None]
        torch.distributed.all_gather_object(gathered, {k: (r.tokens.tolist(), r.logprobs.tolist()) for k, r in got.items()})
        ref = _rollouts(_build(facts, model_dir, 1, device), facts, 1)  # PP=1 (DP=2): the whole model on each rank
        res = {"stage_layers": stage_layers, "ranks_agree": gathered[0] == gathered[1]}
        for key in ("greedy", "greedy_nocache", "greedy_eager"):
            res[f"{key}_tokens_equal"] = torch.equal(got[key].tokens, ref["greedy"].tokens)
            res[f"{key}_logp_diff"] = (got[key].logprobs - ref["greedy"].logprobs).abs().max().item()
        ro, want = got["sampled"], ref["sampled"]
        res["sampled_tokens_equal"] = torch.equal(ro.tokens, want.tokens) and torch.equal(ro.response_mask, want.response_mask)
        res["sampled_logp_diff"] = (ro.logprobs - want.logprobs).abs().max().item()
        res["sampled_lengths"] = ro.response_mask.sum(-1).tolist()
        res["infer_vs_rollout"] = infer_diff
        Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    finally:
        destroy()


@pytest.mark.multiproc
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")])])
def test_pp2_rollout_matches_pp1(tmp_path, device):
    """On CUDA each stage replays its own decode-step graph (TP=1), fed by the received hidden state."""
    from trinity.testing.tiny_models import make_tiny_hf_model

    model_dir = make_tiny_hf_model("qwen2", tmp_path / "qwen2", num_hidden_layers=4, tie_word_embeddings=True)
    run_two_ranks(_worker, str(model_dir), str(tmp_path), device)
    for rank in range(2):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert res["stage_layers"] == 2 and res["ranks_agree"], res
        tol = 1e-5 if device == "cpu" else 1e-4
        for key in ("greedy", "greedy_nocache", "greedy_eager"):
            assert res[f"{key}_tokens_equal"] and res[f"{key}_logp_diff"] <= tol, (key, res)
        # the last stage's generator draws exactly as PP=1's does; some rows stop at an EOS id
        assert res["sampled_tokens_equal"] and res["sampled_logp_diff"] <= tol, res
        assert 0 < min(res["sampled_lengths"]) < 10, res  # some rows stopped early
        assert res["infer_vs_rollout"] <= tol, res


@pytest.mark.multiproc
@pytest.mark.slow
def test_grpo_vpp_matches_pp1(tmp_path):
    """GRPO through `trinity run` with actor and ref at PP=2 x VPP=2 (4 layers, one per model chunk): the
    rollout decodes through both chunks of each rank around the ring of stages, the ref / old log-probs
    and the update run megatron's interleaved schedule (each update's one micro batch, of ppo_mini_batch_size 2
    x n 2 sequences, is filled up to PP = 2 with a copy that adds no gradient); both steps' metrics are PP=1's,
    and the step-2 checkpoint is written from both stages. (VPP runs PP=2's code paths and more: no separate
    PP=2 job.)"""
    from tests.integration.test_rl_cpu import job, rows, run_job
    from trinity.testing.tiny_assets import make_tiny_qwen2, make_tiny_tokenizer, write_prompt_dataset

    tok = make_tiny_tokenizer(tmp_path / "tokenizer")
    model = make_tiny_qwen2(tmp_path / "model", tok, num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2)
    assets = {"model": model, "data": write_prompt_dataset(tmp_path / "prompts.jsonl", 64, seed=0)}
    got = {}
    for name, pp, vpp in (("vpp", 2, 2), ("pp1", 1, None)):
        out = tmp_path / name
        cfg = job(assets, out, "grpo", 2)
        cfg["cluster"]["nproc_per_node"] = pp
        for role in ("actor", "ref"):
            cfg["actor_rollout_ref"][role]["megatron"].update(pipeline_model_parallel_size=pp,
                                                               virtual_pipeline_model_parallel_size=vpp)
        run_job(cfg, tmp_path / f"{name}.yaml")
        got[name] = rows(out)
        assert (out / "checkpoints" / "step_2" / "complete").is_file()
    assert [r["step"] for r in got["vpp"]] == [1, 2] and got["vpp"][0]["response_length/mean"] > 1
    for a, b in zip(got["vpp"], got["pp1"]):
        assert a["reward/mean"] == b["reward/mean"] and a["response_length/mean"] == b["response_length/mean"]
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/ppo_kl", "actor/grad_norm", "actor/ref_kl"):
            assert abs(a[key] - b[key]) <= 1e-5, (key, a[key], b[key])
