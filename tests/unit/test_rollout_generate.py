"""Rollout generation with a real megatron-core GPTModel on CPU (TP=1, fp32)."""

from __future__ import annotations

import pytest
import torch

from trinity.rollout.reference import attention_mask, reference_generate
from trinity.rollout.layout import left_pad
from trinity.rollout.sampler import sample
from trinity.rollout.types import SamplingParams

PROMPTS = [[5, 9, 17, 3, 44, 2], [7, 1], [100, 12, 8, 60]]


@pytest.fixture(scope="module")
def model(tiny_qwen2_cpu):
    return tiny_qwen2_cpu


def test_attention_mask_left_padding():
    keys = torch.tensor([[0, 1, 1]])
    m = attention_mask(keys)[0, 0]
    # query 0 is padding: it keeps only itself; real queries never see the padding key
    assert m.tolist() == [[False, True, True], [True, False, True], [True, False, False]]
    assert attention_mask(keys, sq=1)[0, 0].tolist() == [[True, False, False]]


def test_greedy_with_kv_cache_equals_without(model):
    gpt, facts, _ = model
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    a = reference_generate(gpt, PROMPTS, params, vocab_size=facts.vocab_size, pad_id=0)
    b = reference_generate(gpt, PROMPTS, params, vocab_size=facts.vocab_size, pad_id=0, use_cache=False)
    assert torch.equal(a.tokens, b.tokens)
    assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert a.response_mask.sum().item() == 3 * 8


def test_greedy_matches_hf_and_unpadded(model):
    """Left padding changes nothing: each row alone gives the same tokens, and so does HF greedy."""
    from transformers import AutoModelForCausalLM

    gpt, facts, path = model
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    batched = reference_generate(gpt, PROMPTS, params, vocab_size=facts.vocab_size, pad_id=0)
    hf = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    for i, p in enumerate(PROMPTS):
        alone = reference_generate(gpt, [p], params, vocab_size=facts.vocab_size, pad_id=0)
        assert torch.equal(alone.responses[0], batched.responses[i])
        ids = torch.tensor([p])
        want = hf.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):]
        assert batched.responses[i].tolist() == want.tolist()


def test_rollout_logprobs_equal_training_forward(model):
    from trinity.trainer.recipes.rollout_forward import infer_logprobs

    gpt, facts, _ = model
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, max_new_tokens=10, eos_token_ids=(1, 2, 3))
    ro = reference_generate(gpt, PROMPTS * 2, params, vocab_size=facts.vocab_size, pad_id=0, generator=g)
    trained = infer_logprobs([gpt], ro, facts.vocab_size, micro_batch=4)
    assert ro.response_mask.sum() > 0
    assert (trained - ro.logprobs).abs().max().item() <= 1e-5
    # rows stop at EOS: the mask ends at the first EOS id, later tokens are padding
    for row, mask in zip(ro.responses, ro.response_mask):
        n = int(mask.sum())
        hit = [j for j, t in enumerate(row.tolist()[:n]) if t in (1, 2, 3)]
        assert hit == [] and n == ro.response_len or hit == [n - 1]
        assert all(t == 0 for t in row.tolist()[n:])


def test_sampling_filters():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]]).repeat(2000, 1)
    g = torch.Generator().manual_seed(0)
    top1 = sample(logits, SamplingParams(top_k=1), g)
    assert set(top1.tolist()) == {0}
    top2 = sample(logits, SamplingParams(top_k=2), g)
    assert set(top2.tolist()) == {0, 1}
    p = torch.softmax(logits[0], -1)
    nucleus = sample(logits, SamplingParams(top_p=float(p[0] + 0.01)), g)  # needs the first two
    assert set(nucleus.tolist()) == {0, 1}
    hot = sample(logits, SamplingParams(temperature=100.0), g)
    assert set(hot.tolist()) == {0, 1, 2, 3}


def test_left_pad():
    tokens, mask = left_pad([[1, 2, 3], [4]], pad_id=9, device=torch.device("cpu"))
    assert tokens.tolist() == [[1, 2, 3], [9, 9, 4]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]



def test_rows_stop_at_their_first_eos(model):
    from trinity.testing.rollout_checks import check_stops_at_eos

    gpt, facts, _ = model
    assert check_stops_at_eos(gpt, PROMPTS, facts.vocab_size) <= 3
    assert check_stops_at_eos(gpt, PROMPTS, facts.vocab_size, use_cache=False) <= 3
