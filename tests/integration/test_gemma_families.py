"""Gemma 2 and Gemma 3 (text) end to end on tiny models (CPU, fp32): the rollout engine's decoders against
HF generate, training, refusals. Conversion (logits, round trip) is in test_convert_roundtrip.py, TP/PP
logits in test_models_tp2.py.

The tiny models (trinity.testing.tiny_models) turn every feature on where it bites: sliding windows of 4
keys (shorter than prompt + response), soft caps of a few units, query_pre_attn_scalar unlike head_dim,
Gemma 3's local RoPE base and linear scaling on global layers."""

from __future__ import annotations

import json

import pytest
import torch

from trinity.errors import UserError
from trinity.models.facts import ModelFacts
from trinity.rollout.generate import SamplingParams, generate

pytestmark = pytest.mark.timeout(180)

GEMMA = ["gemma2"]
# prompts of different lengths (left padding in the static batch), the longest past the window
PROMPTS = [[5, 9, 17, 3, 44, 2, 8, 11], [7, 1], [100, 12, 8, 60]]
NEW = 8


@pytest.mark.parametrize("family", GEMMA)
def test_greedy_static_and_continuous_equal_hf_generate(family, tmp_path):
    """Static batch (KV cache and full forwards) and the continuous engine give HF's greedy tokens: the
    window over the cache, the capped scores, sandwich norms, embedding scale and capped logits of the
    decoders' module path."""
    from transformers import AutoModelForCausalLM

    from tests.unit.test_rollout_decode import _tiny_gpt
    from trinity.rollout.continuous import KVBudget, generate_continuous

    with _tiny_gpt(family, tmp_path) as (gpt, facts):
        params = SamplingParams(temperature=0.0, max_new_tokens=NEW)
        static = generate(gpt, PROMPTS, params, vocab_size=facts.vocab_size, pad_id=0)
        full = generate(gpt, PROMPTS, params, vocab_size=facts.vocab_size, pad_id=0, use_cache=False)
        cont = generate_continuous(gpt, PROMPTS, params, vocab_size=facts.vocab_size, pad_id=0,
                                   budget=KVBudget(max_num_seqs=2))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    for i, p in enumerate(PROMPTS):
        want = hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(p):].tolist()
        assert static.responses[i].tolist() == want, i
        assert full.responses[i].tolist() == want, i
        assert cont.responses[i].tolist() == want, i
    assert (static.logprobs - full.logprobs).abs().max().item() <= 1e-5
    assert (static.logprobs - cont.logprobs).abs().max().item() <= 1e-5
