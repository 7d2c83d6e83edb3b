"""The rollout engine on the real model: greedy chat answers equal transformers' `generate`, token for
token (fp32, CPU). (`trinity generate` on the real model: test_real_sft.py, on a run folder.)"""

from __future__ import annotations

import pytest
import torch

from trinity.testing.rollout_checks import check_greedy_equals_hf

pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = [
    "What is the capital of France?",
    "What is 3 + 4? Answer with the number only.",
    "Write one sentence about the sea.",
]
NEW = 24


def test_greedy_chat_answers_equal_hf_generate(real_model):
    from transformers import AutoModelForCausalLM

    from trinity.cli.generate import eos_ids
    from trinity.config.megatron import MegatronConfig
    from trinity.convert.builtin import load_hf_weights
    from trinity.data.loader import load_tokenizer, pad_token_id
    from trinity.data.sft import render_prompt, tokenize_texts
    from trinity.distributed.parallel import destroy, init_parallel
    from trinity.models.build import build_model
    from trinity.models.facts import ModelFacts
    from trinity.rollout.reference import reference_generate
    from trinity.rollout.types import SamplingParams

    tok = load_tokenizer(real_model)
    ids = tokenize_texts(tok, [render_prompt(tok, p) for p in PROMPTS])
    eos = eos_ids(tok, real_model)
    assert eos == (tok.convert_tokens_to_ids("<|im_end|>"),)  # ChatML's end of turn stops the answer
    facts = ModelFacts.from_hf_dir(real_model)
    assert (facts.num_layers, facts.hidden_size, facts.vocab_size) == (30, 576, 49152)
    megatron = MegatronConfig()
    init_parallel(device="cpu", layout=megatron.layout(), seed=0)
    try:
        chunks = build_model(facts, megatron, device="cpu", dtype=torch.float32)
        load_hf_weights(chunks, real_model, facts)
        params = SamplingParams(temperature=0.0, max_new_tokens=NEW, eos_token_ids=eos)
        with torch.no_grad():
            ro = reference_generate(chunks[0], ids, params, vocab_size=facts.vocab_size, pad_id=pad_token_id(tok))
    finally:
        destroy()
    del chunks
    hf = AutoModelForCausalLM.from_pretrained(str(real_model), dtype=torch.float32).eval()
    answers = check_greedy_equals_hf(ro, hf, ids, NEW, tok.decode)
    # a trained model, not random weights: it knows this one and ends its turn
    assert "Paris" in answers[0] and answers[0].endswith("<|im_end|>"), answers[0]
