"""The static-cache decoder (trinity.rollout.decode) across model families on CPU (TP=1, fp32)."""

from __future__ import annotations

import pytest
import torch

from trinity.config.megatron import MegatronConfig
from trinity.distributed.layout import ParallelLayout
from trinity.models.facts import ModelFacts
from trinity.rollout.generate import SamplingParams, generate

PROMPTS = [[5, 9, 17, 3, 44, 2], [7, 1], [100, 12, 8, 60]]


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "mixtral"])
def test_static_cache_decoding_equals_full_forward_per_family(family, tmp_path):
    """The static-cache decoder drives megatron's submodules itself: QK-norm (qwen3), untied heads
    (llama), MoE layers (qwen3_moe, mixtral) must give the tokens and log-probs of full forwards."""
    from trinity.convert.builtin import load_hf_weights
    from trinity.distributed.parallel import destroy, init_parallel
    from trinity.models.build import build_model
    from trinity.testing.tiny_models import make_tiny_hf_model

    path = make_tiny_hf_model(family, tmp_path)
    facts = ModelFacts.from_hf_dir(path)
    init_parallel(device="cpu", layout=ParallelLayout(), seed=3)
    try:
        (gpt,) = build_model(facts, MegatronConfig(), device="cpu", dtype=torch.float32)
        load_hf_weights([gpt], path, facts)
        params = SamplingParams(temperature=0.0, max_new_tokens=6)
        a = generate(gpt, PROMPTS, params, vocab_size=facts.vocab_size, pad_id=0)
        b = generate(gpt, PROMPTS, params, vocab_size=facts.vocab_size, pad_id=0, use_cache=False)
        assert torch.equal(a.tokens, b.tokens)
        assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5)
    finally:
        destroy()
