"""Each added model family on CUDA: our bf16 logits against HF's (HF fp32 the reference), and the rollout
engine's CUDA-graph decode against full forwards.

`pytest -m gpu tests/gpu/test_families_gpu.py` (one GPU)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# Larger than the CPU tests' tiny models, so that bf16 rounding adds up as in a real model; each shape
# keeps its family's features biting (sequences past the sliding window, several sliding/global layers).
SHAPES: dict[str, dict] = {
    "gemma2": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=64, vocab_size=4096, max_position_embeddings=1024,
                   sliding_window=64, query_pre_attn_scalar=64, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0, initializer_range=0.05),
    # the 1B's pattern and RoPE bases (5 sliding : 1 global, local 10k, global 1M), linear scaling 8 as
    # the larger Gemma 3 checkpoints have it
    "gemma3": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
                   num_key_value_heads=2, head_dim=64, vocab_size=4096, max_position_embeddings=1024,
                   sliding_window=64, query_pre_attn_scalar=64, initializer_range=0.05,
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
}
SEQ = 256


@pytest.fixture(scope="module")
def cuda_tp1():
    from trinity.distributed import cpu_compat
    from trinity.distributed.layout import ParallelLayout
    from trinity.distributed.parallel import destroy, init_parallel

    cpu_compat.disable()  # an earlier CPU test in this process may have mapped cuda to cpu
    init_parallel(device="cuda", layout=ParallelLayout(), seed=7)
    yield
    destroy()


def _hf_logits(path, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).cuda().eval()
    with torch.no_grad():
        out = model(ids).logits.float()
    del model
    return out


def _ours(facts, path, dtype: torch.dtype):
    from trinity.config.megatron import MegatronConfig
    from trinity.convert.builtin import load_hf_weights
    from trinity.models.build import build_model

    (model,) = build_model(facts, MegatronConfig(), device="cuda", dtype=dtype)
    load_hf_weights([model], path, facts)
    return model.eval()


@pytest.mark.parametrize("family", sorted(SHAPES))
def test_bf16_logits_within_hf_bf16_noise(cuda_tp1, tmp_path, family):
    from trinity.models.facts import ModelFacts
    from trinity.testing.tiny_models import make_tiny_hf_model

    path = make_tiny_hf_model(family, tmp_path / family, tie_word_embeddings=True, **SHAPES[family])
    facts = ModelFacts.from_hf_dir(path)
    ids = torch.randint(0, facts.vocab_size, (2, SEQ), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    ref = _hf_logits(path, ids, torch.float32)
    hf_bf16 = _hf_logits(path, ids, torch.bfloat16)
    model = _ours(facts, path, torch.bfloat16)
    pos = torch.arange(SEQ, device="cuda").expand(2, SEQ)
    with torch.no_grad():
        ours = model(ids, pos, None)[..., : facts.vocab_size].float()
    theirs_err = (hf_bf16 - ref).abs()
    ours_err = (ours - ref).abs()
    # HF's own bf16 noise bounds ours (max and mean), with a margin for a different order of the ops
    assert ours_err.max() <= 2.0 * theirs_err.max() + 1e-2, (ours_err.max().item(), theirs_err.max().item())
    assert ours_err.mean() <= 2.0 * theirs_err.mean() + 1e-3, (ours_err.mean().item(), theirs_err.mean().item())


@pytest.mark.parametrize("family", sorted(SHAPES))
def test_cuda_graph_decoding_equals_full_forwards(cuda_tp1, tmp_path, family):
    """fp32 on CUDA: the static batch (one CUDA graph per decode step) and the continuous engine (graphs
    per bucket) give the tokens and log-probs of full forwards, with prompts + responses past the window."""
    from trinity.models.facts import ModelFacts
    from trinity.rollout.continuous import KVBudget, generate_continuous
    from trinity.rollout.generate import SamplingParams, generate
    from trinity.testing.tiny_models import make_tiny_hf_model

    path = make_tiny_hf_model(family, tmp_path / family, tie_word_embeddings=True, **SHAPES[family])
    facts = ModelFacts.from_hf_dir(path)
    model = _ours(facts, path, torch.float32)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, facts.vocab_size, (n,), generator=g).tolist() for n in (70, 5, 33, 90)]
    params = SamplingParams(temperature=0.0, max_new_tokens=40)
    full = generate(model, prompts, params, vocab_size=facts.vocab_size, pad_id=0, use_cache=False)
    static = generate(model, prompts, params, vocab_size=facts.vocab_size, pad_id=0)
    cont = generate_continuous(model, prompts, params, vocab_size=facts.vocab_size, pad_id=0,
                               budget=KVBudget(max_num_seqs=3))
    for got in (static, cont):
        assert torch.equal(got.tokens, full.tokens)
        assert (got.logprobs - full.logprobs).abs().max().item() <= 1e-3
