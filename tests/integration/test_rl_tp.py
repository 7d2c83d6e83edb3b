"""Rollout and log-probs at TP=2 (2 processes, gloo) against TP=1 through the real megatron model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.conftest import run_two_ranks

PROMPTS = [[5, 9, 17, 3, 44, 2], [7, 1], [100, 12, 8, 60], [33, 34]]


def _build(facts, path, tp: int):
    from trinity.config.megatron import MegatronConfig
    from trinity.convert.builtin import load_hf_weights
    from trinity.distributed.parallel import init_parallel
    from trinity.models.build import build_model

    m = MegatronConfig(tensor_model_parallel_size=tp)
    init_parallel(device="cpu", layout=m.layout(), seed=3)
    (model,) = build_model(facts, m, device="cpu", dtype=torch.float32)
    load_hf_weights([model], path, facts)
    return model


def _worker(rank: int, port: int, model_dir: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from trinity.distributed.parallel import destroy
    from trinity.models.facts import ModelFacts
    from trinity.rollout.reference import reference_generate
    from trinity.rollout.types import SamplingParams
    from trinity.trainer.recipes.rollout_forward import infer_logprobs

    facts = ModelFacts.from_hf_dir(model_dir)
    try:
        tp2 = _build(facts, model_dir, 2)
        # different seeds per rank: the TP broadcast must still make both ranks agree
        g = torch.Generator().manual_seed(rank)
        ro = reference_generate(tp2, PROMPTS, SamplingParams(max_new_tokens=8), vocab_size=facts.vocab_size, pad_id=0, generator=g)
        greedy2 = reference_generate(tp2, PROMPTS, SamplingParams(temperature=0, max_new_tokens=8), vocab_size=facts.vocab_size, pad_id=0)
        lp2 = infer_logprobs([tp2], ro, facts.vocab_size, 2)
        tokens = [None, None]
        torch.distributed.all_gather_object(tokens, ro.tokens.tolist())
        tp1 = _build(facts, model_dir, 1)
        lp1 = infer_logprobs([tp1], ro, facts.vocab_size, 2)
        greedy1 = reference_generate(tp1, PROMPTS, SamplingParams(temperature=0, max_new_tokens=8), vocab_size=facts.vocab_size, pad_id=0)
        if rank == 0:
            Path(out).write_text(json.dumps({
                "ranks_agree": tokens[0] == tokens[1],
                "rollout_vs_tp2": (ro.logprobs - lp2).abs().max().item(),
                "tp2_vs_tp1": (lp2 - lp1).abs().max().item(),
                "greedy_equal": torch.equal(greedy1.tokens, greedy2.tokens),
                "tokens": int(ro.response_mask.sum()),
            }))
    finally:
        destroy()


@pytest.mark.multiproc
@pytest.mark.slow
def test_tp2_rollout_and_logprobs_match_tp1(tmp_path):
    from trinity.testing.tiny_models import make_tiny_hf_model

    model_dir = make_tiny_hf_model("qwen2", tmp_path / "qwen2")
    out = tmp_path / "result.json"
    run_two_ranks(_worker, str(model_dir), str(out))
    res = json.loads(out.read_text())
    assert res["ranks_agree"] and res["greedy_equal"] and res["tokens"] > 0
    assert res["rollout_vs_tp2"] <= 1e-5 and res["tp2_vs_tp1"] <= 1e-5, res
