"""Each added model family on CUDA: our bf16 logits against HF's (HF fp32 the reference), and the rollout
engine's decoding against full forwards; MoE families also at EP=2 on two GPUs.

`pytest -m gpu tests/gpu/test_families_gpu.py` (one GPU; the EP=2 test needs two)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# Larger than the CPU tests' tiny models, so that bf16 rounding adds up as in a real model; each shape
# keeps its family's features biting (Gemma: sequences past the sliding window, several sliding/global
# layers).
_SIZE = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, vocab_size=1024, max_position_embeddings=1024)
SHAPES: dict[str, dict] = {
    # Mistral and Phi-3 with windows much shorter than the sequences, Qwen2-MoE's gated shared expert,
    # GLM-4's post-block norms and half-head interleaved RoPE
    "mistral": dict(_SIZE, sliding_window=32),
    "phi3": dict(_SIZE, sliding_window=48),
    "qwen2_moe": dict(_SIZE, moe_intermediate_size=256, shared_expert_intermediate_size=512),
    "glm4": dict(_SIZE),
    # V2-Lite's layout: no q LoRA, a dense first layer, greedy softmax routing with 2 shared experts
    "deepseek_v2": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=8, vocab_size=4096, max_position_embeddings=1024, q_lora_rank=None,
                        kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, head_dim=32,
                        n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2, moe_intermediate_size=256,
                        first_k_dense_replace=1, topk_method="greedy", routed_scaling_factor=1.0,
                        initializer_range=0.05),
    # V3's: q LoRA, YaRN with both mscales, sigmoid routing with the score bias over 4 groups of 2
    "deepseek_v3": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=8, vocab_size=4096, max_position_embeddings=1024, q_lora_rank=192,
                        kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, head_dim=32,
                        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=4, moe_intermediate_size=256,
                        first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                        initializer_range=0.05,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1,
                                         "mscale": 1.0, "mscale_all_dim": 1.0}),
    "gemma2": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=64, vocab_size=4096, max_position_embeddings=1024,
                   sliding_window=64, query_pre_attn_scalar=64, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0, initializer_range=0.05, tie_word_embeddings=True),
    # the 1B's pattern and RoPE bases (5 sliding : 1 global, local 10k, global 1M), linear scaling 8 as
    # the larger Gemma 3 checkpoints have it
    "gemma3": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
                   num_key_value_heads=2, head_dim=64, vocab_size=4096, max_position_embeddings=1024,
                   sliding_window=64, query_pre_attn_scalar=64, initializer_range=0.05, tie_word_embeddings=True,
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
}
MOE = ("deepseek_v2", "deepseek_v3", "qwen2_moe")
SEQ = 256


@pytest.fixture(scope="module")
def cuda_tp1():
    from trinity.compat import cpu_compat
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


def _ours(facts, path, dtype: torch.dtype, **block):
    from trinity.config.megatron import MegatronConfig
    from trinity.convert.builtin import load_hf_weights
    from trinity.models.build import build_model

    (model,) = build_model(facts, MegatronConfig(**block), device="cuda", dtype=dtype)
    load_hf_weights([model], path, facts)
    return model.eval()


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(0)).cuda()


@pytest.mark.parametrize("family", sorted(SHAPES))
def test_bf16_logits_within_hf_bf16_noise(cuda_tp1, tmp_path, family):
    from trinity.models.facts import ModelFacts
    from trinity.testing.tiny_models import make_tiny_hf_model

    path = make_tiny_hf_model(family, tmp_path / family, **SHAPES[family])
    facts = ModelFacts.from_hf_dir(path)
    ids = _ids(facts.vocab_size)
    ref = _hf_logits(path, ids, torch.float32)
    hf_bf16 = _hf_logits(path, ids, torch.bfloat16)
    model = _ours(facts, path, torch.bfloat16)
    pos = torch.arange(SEQ, device="cuda").expand(2, SEQ)
    with torch.no_grad():
        ours = model(ids, pos, None)[..., : facts.vocab_size].float()
    theirs_err = (hf_bf16 - ref).abs()
    ours_err = (ours - ref).abs()
    assert ours_err.max() <= 2.0 * theirs_err.max() + 1e-2, (ours_err.max().item(), theirs_err.max().item())
    assert ours_err.mean() <= 2.0 * theirs_err.mean() + 1e-3, (ours_err.mean().item(), theirs_err.mean().item())


@pytest.mark.parametrize("family", sorted(SHAPES))
def test_decoding_equals_full_forwards(cuda_tp1, tmp_path, family):
    """fp32 on CUDA: the static batch (a CUDA graph per decode step where the family allows) and the
    continuous engine give the tokens and log-probs of full forwards, with prompts + responses past
    Gemma's window (MLA: per-head K/V from the latent, module path)."""
    from trinity.models.facts import ModelFacts
    from trinity.rollout.continuous import KVBudget, generate_continuous
    from trinity.rollout.reference import reference_generate
    from trinity.rollout.types import SamplingParams
    from trinity.testing.tiny_models import make_tiny_hf_model

    path = make_tiny_hf_model(family, tmp_path / family, **SHAPES[family])
    facts = ModelFacts.from_hf_dir(path)
    model = _ours(facts, path, torch.float32)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, facts.vocab_size, (n,), generator=g).tolist() for n in (70, 5, 33, 90)]
    params = SamplingParams(temperature=0.0, max_new_tokens=40)
    full = reference_generate(model, prompts, params, vocab_size=facts.vocab_size, pad_id=0, use_cache=False)
    static = reference_generate(model, prompts, params, vocab_size=facts.vocab_size, pad_id=0)
    cont = generate_continuous(model, prompts, params, vocab_size=facts.vocab_size, pad_id=0,
                               budget=KVBudget(max_num_seqs=3))
    for got in (static, cont):
        assert torch.equal(got.tokens, full.tokens)
        assert (got.logprobs - full.logprobs).abs().max().item() <= 1e-3


def _ep2_worker(rank: int, port: int, family: str, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    torch.cuda.set_device(rank)
    from trinity.distributed.layout import ParallelLayout
    from trinity.distributed.parallel import destroy, init_parallel
    from trinity.models.facts import ModelFacts

    path = Path(root) / family
    facts = ModelFacts.from_hf_dir(path)
    init_parallel(device="cuda", layout=ParallelLayout(ep=2), seed=7)
    try:
        model = _ours(facts, path, torch.float32, expert_model_parallel_size=2)
        pos = torch.arange(SEQ, device="cuda").expand(2, SEQ)
        with torch.no_grad():
            logits = model(_ids(facts.vocab_size), pos, None)[..., : facts.vocab_size].float().cpu()
        torch.save(logits, Path(root) / f"{family}_ep2_rank{rank}.pt")
    finally:
        destroy()


@pytest.mark.multiproc
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("family", MOE)
def test_ep2_equals_ep1(cuda_tp1, tmp_path, family):
    """fp32: each of two GPUs holds half of the routed experts (tokens exchanged all-to-all over NCCL);
    both ranks' logits equal EP=1's on one GPU."""
    import torch.multiprocessing as mp

    from trinity.distributed.parallel import free_port
    from trinity.models.facts import ModelFacts
    from trinity.testing.tiny_models import make_tiny_hf_model

    path = make_tiny_hf_model(family, tmp_path / family, **SHAPES[family])
    facts = ModelFacts.from_hf_dir(path)
    model = _ours(facts, path, torch.float32)
    pos = torch.arange(SEQ, device="cuda").expand(2, SEQ)
    with torch.no_grad():
        ep1 = model(_ids(facts.vocab_size), pos, None)[..., : facts.vocab_size].float().cpu()
    del model
    mp.start_processes(_ep2_worker, args=(free_port(), family, str(tmp_path)), nprocs=2, start_method="spawn", join=True)
    for rank in range(2):
        ep2 = torch.load(tmp_path / f"{family}_ep2_rank{rank}.pt")
        assert (ep2 - ep1).abs().max().item() <= 1e-4, rank


def test_windowed_rollout_replays_cuda_graphs_and_equals_eager(cuda_tp1, tmp_path):
    """A sliding-window model on the continuous engine's CUDA path (SDPA with the window mask, captured
    decode steps) gives the tokens of the same steps run eagerly and of the static decoder."""
    from trinity.models.facts import ModelFacts
    from trinity.rollout.continuous import KVBudget, RolloutStats, generate_continuous
    from trinity.rollout.reference import reference_generate
    from trinity.rollout.types import SamplingParams
    from trinity.testing.tiny_models import make_tiny_hf_model

    path = make_tiny_hf_model("mistral", tmp_path / "mistral", **SHAPES["mistral"])
    facts = ModelFacts.from_hf_dir(path)
    gpt = _ours(facts, path, torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, facts.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(4, 60, (12,), generator=g)]
    params = SamplingParams(temperature=0.0, max_new_tokens=64)
    kw = dict(vocab_size=facts.vocab_size, pad_id=0)
    stats = RolloutStats()
    graphs = generate_continuous(gpt, prompts, params, stats=stats, budget=KVBudget(max_num_seqs=4), **kw)
    eager = generate_continuous(gpt, prompts, params, cuda_graphs=False, budget=KVBudget(max_num_seqs=4), **kw)
    static = reference_generate(gpt, prompts, params, **kw)
    assert stats.graph_captures > 0
    assert torch.equal(graphs.tokens, eager.tokens)
    assert graphs.responses.tolist() == static.responses.tolist()
