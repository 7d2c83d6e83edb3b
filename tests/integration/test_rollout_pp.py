"""Rollout at PP=2 (2 processes, gloo, fp32) against PP=1 through the real megatron model: each stage runs
its own layers and KV cache, hidden states go stage to stage, the last stage samples and broadcasts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

PROMPTS = [[5, 9, 17, 3, 44, 2], [7, 1], [100, 12, 8, 60], [33, 34]]


def _build(facts, path, pp: int):
    from trinity.config.megatron import MegatronConfig
    from trinity.convert.builtin import load_hf_weights
    from trinity.distributed.parallel import init_parallel
    from trinity.models.build import build_model

    m = MegatronConfig(pipeline_model_parallel_size=pp)
    init_parallel(device="cpu", layout=m.layout(), seed=3)
    (model,) = build_model(facts, m, device="cpu", dtype=torch.float32)
    load_hf_weights([model], path, facts)
    return model


def _rollouts(model, facts, pp: int) -> dict:
    from trinity.rollout.generate import SamplingParams, generate

    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    hot = SamplingParams(temperature=1.0, top_k=50, max_new_tokens=10, eos_token_ids=tuple(range(1, 40)))
    kw = dict(vocab_size=facts.vocab_size, pad_id=0)
    out = {"greedy": generate(model, PROMPTS, greedy, **kw)}
    if pp == 1:  # the reference sample: seed 1
        out["sampled"] = generate(model, PROMPTS * 2, hot, generator=torch.Generator().manual_seed(1), **kw)
    else:  # each rank passes its own seed: only the last stage (rank 1) samples, so seed 1 must win
        seed = torch.distributed.get_rank()
        out["sampled"] = generate(model, PROMPTS * 2, hot, generator=torch.Generator().manual_seed(seed), **kw)
        out["greedy_nocache"] = generate(model, PROMPTS, greedy, use_cache=False, **kw)
    return out


def _worker(rank: int, port: int, model_dir: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from trinity.distributed.parallel import destroy
    from trinity.models.facts import ModelFacts

    facts = ModelFacts.from_hf_dir(model_dir)
    try:
        pp2 = _build(facts, model_dir, 2)
        stage_layers = len(pp2.decoder.layers)
        got = _rollouts(pp2, facts, 2)
        gathered = [None, None]
        torch.distributed.all_gather_object(gathered, {k: (r.tokens.tolist(), r.logprobs.tolist()) for k, r in got.items()})
        ref = _rollouts(_build(facts, model_dir, 1), facts, 1)  # PP=1 (DP=2): the whole model on each rank
        res = {"stage_layers": stage_layers, "ranks_agree": gathered[0] == gathered[1]}
        for key in ("greedy", "greedy_nocache"):
            res[f"{key}_tokens_equal"] = torch.equal(got[key].tokens, ref["greedy"].tokens)
            res[f"{key}_logp_diff"] = (got[key].logprobs - ref["greedy"].logprobs).abs().max().item()
        ro, want = got["sampled"], ref["sampled"]
        res["sampled_tokens_equal"] = torch.equal(ro.tokens, want.tokens) and torch.equal(ro.response_mask, want.response_mask)
        res["sampled_logp_diff"] = (ro.logprobs - want.logprobs).abs().max().item()
        res["sampled_lengths"] = ro.response_mask.sum(-1).tolist()
        Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    finally:
        destroy()


@pytest.mark.multiproc
def test_pp2_rollout_matches_pp1(tmp_path):
    from trinity.distributed.parallel import free_port
    from trinity.testing.tiny_models import make_tiny_hf_model

    model_dir = make_tiny_hf_model("qwen2", tmp_path / "qwen2", num_hidden_layers=4, tie_word_embeddings=True)
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, str(model_dir), str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
        if p.is_alive():
            p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    for rank in range(2):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert res["stage_layers"] == 2 and res["ranks_agree"], res
        assert res["greedy_tokens_equal"] and res["greedy_nocache_tokens_equal"], res
        assert res["greedy_logp_diff"] <= 1e-5 and res["greedy_nocache_logp_diff"] <= 1e-5, res
        # the last stage's generator draws exactly as PP=1's does; some rows stop at an EOS id
        assert res["sampled_tokens_equal"] and res["sampled_logp_diff"] <= 1e-5, res
        assert 0 < min(res["sampled_lengths"]) < 10, res  # some rows stopped early
