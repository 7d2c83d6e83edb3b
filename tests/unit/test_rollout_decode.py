"""The static-cache decoder (trinity.rollout.decode) across model families on CPU (TP=1, fp32)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest
import torch

from trinity.config.megatron import MegatronConfig
from trinity.distributed.layout import ParallelLayout
from trinity.models.facts import ModelFacts
from trinity.rollout.reference import reference_generate
from trinity.rollout.types import SamplingParams

PROMPTS = [[5, 9, 17, 3, 44, 2], [7, 1], [100, 12, 8, 60]]


@contextlib.contextmanager
def _tiny_gpt(family: str, tmp_path, load: bool = True) -> Iterator[tuple[object, ModelFacts]]:
    """A tiny HF model of `family` as a megatron GPTModel on CPU (fp32, TP=1), its HF weights loaded."""
    from trinity.convert.builtin import load_hf_weights
    from trinity.distributed.parallel import destroy, init_parallel
    from trinity.models.build import build_model
    from trinity.testing.tiny_models import make_tiny_hf_model

    path = make_tiny_hf_model(family, tmp_path)
    facts = ModelFacts.from_hf_dir(path)
    init_parallel(device="cpu", layout=ParallelLayout(), seed=3)
    try:
        (gpt,) = build_model(facts, MegatronConfig(), device="cpu", dtype=torch.float32)
        if load:
            load_hf_weights([gpt], path, facts)
        yield gpt, facts
    finally:
        destroy()


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "mixtral"])
def test_static_cache_decoding_equals_full_forward_per_family(family, tmp_path):
    """The static-cache decoder drives megatron's submodules itself: QK-norm (qwen3), untied heads
    (llama), MoE layers (qwen3_moe, mixtral) must give the tokens and log-probs of full forwards."""
    with _tiny_gpt(family, tmp_path) as (gpt, facts):
        params = SamplingParams(temperature=0.0, max_new_tokens=6)
        a = reference_generate(gpt, PROMPTS, params, vocab_size=facts.vocab_size, pad_id=0)
        b = reference_generate(gpt, PROMPTS, params, vocab_size=facts.vocab_size, pad_id=0, use_cache=False)
        assert torch.equal(a.tokens, b.tokens)
        assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_lean_layer_path_equals_megatron_module_path(family, tmp_path):
    """The lean path (our own kernels over megatron's weights: grouped query heads stacked along the
    query axis, RoPE on q and k together, residuals in addmm) gives the logits of the path that calls
    megatron's submodules, at prefill and at every decode step; MoE layers keep the module path."""
    from trinity.rollout.decode import StaticDecoder
    from trinity.rollout.layout import left_pad

    with _tiny_gpt(family, tmp_path) as (gpt, _):
        gpt.eval()
        tokens, key_mask = left_pad(PROMPTS, 0, torch.device("cpu"))
        lean = StaticDecoder(gpt, len(PROMPTS), tokens.shape[1] + 5)
        module = StaticDecoder(gpt, len(PROMPTS), tokens.shape[1] + 5)
        assert lean.lean and module.lean
        module.lean = False
        a, b = lean.prefill(tokens, key_mask), module.prefill(tokens, key_mask)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        for step in range(4):
            nxt = a.argmax(-1)
            a = lean.step(nxt, tokens.shape[1] + step)
            b = module.step(nxt, tokens.shape[1] + step)
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert lean.keys[0].shape[2] % 64 == 0  # cache rounded up; the spare slots stay masked


def test_moe_layers_take_the_module_path(tmp_path):
    from trinity.rollout.decode import StaticDecoder

    with _tiny_gpt("qwen3_moe", tmp_path, load=False) as (gpt, _):
        assert not StaticDecoder(gpt, 2, 8).lean
