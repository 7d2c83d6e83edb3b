"""Static-cache decoding on CUDA: CUDA-graph replay gives the tokens of eager steps and of full forwards.

Run on a GPU machine: `python -m pytest tests/gpu/test_decode_gpu.py -q`.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_cuda_graph_decode_matches_eager_and_full_forward(tmp_path):
    from trinity.config.megatron import MegatronConfig
    from trinity.convert.builtin import load_hf_weights
    from trinity.distributed.layout import ParallelLayout
    from trinity.distributed.parallel import destroy, init_parallel
    from trinity.models.build import build_model
    from trinity.models.facts import ModelFacts
    from trinity.rollout.reference import reference_generate
    from trinity.rollout.types import SamplingParams
    from trinity.testing.tiny_models import make_tiny_hf_model

    path = make_tiny_hf_model("qwen2", tmp_path, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=512)
    facts = ModelFacts.from_hf_dir(path)
    init_parallel(device="cuda", layout=ParallelLayout(), seed=1)
    try:
        (gpt,) = build_model(facts, MegatronConfig(), device="cuda", dtype=torch.float32)
        load_hf_weights([gpt], path, facts)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(1, facts.vocab_size, (n,), generator=g).tolist() for n in (3, 17, 9, 30)]
        params = SamplingParams(temperature=0.0, max_new_tokens=24)
        kw = dict(vocab_size=facts.vocab_size, pad_id=0)
        graphed = reference_generate(gpt, prompts, params, **kw)
        eager = reference_generate(gpt, prompts, params, cuda_graphs=False, **kw)
        full = reference_generate(gpt, prompts, params, use_cache=False, **kw)
        assert torch.equal(graphed.tokens, eager.tokens) and torch.equal(graphed.tokens, full.tokens)
        assert (graphed.logprobs - eager.logprobs).abs().max().item() == 0.0
        assert (graphed.logprobs - full.logprobs).abs().max().item() <= 1e-4
        compiled = reference_generate(gpt, prompts, params, compile=True, **kw)
        assert torch.equal(compiled.tokens, full.tokens)
        assert (compiled.logprobs - full.logprobs).abs().max().item() <= 1e-4
        # a second call captures its own graph (new batch size, new cache) and still agrees
        again = reference_generate(gpt, prompts[:2], params, **kw)
        assert torch.equal(again.responses, full.responses[:2])
        # EOS: the "every row stopped" flag is read one step late on CUDA; that step must not show
        from trinity.testing.rollout_checks import check_stops_at_eos

        check_stops_at_eos(gpt, prompts, facts.vocab_size)
        check_stops_at_eos(gpt, prompts, facts.vocab_size, cuda_graphs=False)
    finally:
        destroy()
