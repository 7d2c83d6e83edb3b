"""Packed (padding-free) RL phases on one GPU: the same log-probs and losses as padded rows in bf16 (flash
varlen) within bf16 tolerance, and in fp32 within 1e-4; prints the time, real tokens/s and padding
fraction of both layouts.

Run on a GPU machine: `python -m pytest tests/gpu/test_rl_packed_gpu.py -q -s`.
"""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BATCH, PROMPT, RESPONSE, MICRO = 64, 128, 512, 8


@pytest.fixture(scope="module")
def setup(qwen2_small_cuda):
    return qwen2_small_cuda


def _engine(facts, path, dtype):
    from trinity.config.megatron import MegatronConfig
    from trinity.config.roles import Role
    from trinity.config.schema import OptimConfig
    from trinity.convert.builtin import load_hf_weights
    from trinity.models.build import build_model
    from trinity.trainer.engine import RoleEngine

    m = MegatronConfig()
    chunks = build_model(facts, m, device="cuda", dtype=dtype)
    load_hf_weights(chunks, path, facts)
    return RoleEngine(Role.actor, chunks, m, OptimConfig(lr=1e-5, weight_decay=0.0), dtype=dtype, total_steps=10)


def _rollout(vocab: int):
    """Left-padded prompts and right-padded responses of lognormal lengths (mean ~30% of the maximum)."""
    from trinity.rollout.types import Rollout

    g = torch.Generator().manual_seed(0)
    p = torch.randint(16, PROMPT + 1, (BATCH,), generator=g)
    r = torch.exp(torch.randn(BATCH, generator=g) * 0.6 + torch.log(torch.tensor(RESPONSE * 0.25))).long().clamp(1, RESPONSE)
    tokens = torch.randint(3, vocab, (BATCH, PROMPT + RESPONSE), generator=g)
    cols = torch.arange(PROMPT + RESPONSE)
    prompt_mask = (cols[:PROMPT] >= PROMPT - p[:, None]).long()
    response_mask = (cols[:RESPONSE] < r[:, None]).long()
    tokens[:, :PROMPT][prompt_mask == 0] = 0
    tokens[:, PROMPT:][response_mask == 0] = 0
    return Rollout(tokens.cuda(), prompt_mask.cuda(), response_mask.cuda(), torch.zeros(BATCH, RESPONSE, device="cuda"))


def _timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_matches_padded_on_cuda(setup, dtype):
    from trinity.config.schema import ActorConfig
    from trinity.trainer.recipes.rl_update import Experience, actor_update
    from trinity.trainer.recipes.rollout_forward import Batching, infer_logprobs

    facts, path = setup
    ro = _rollout(facts.vocab_size)
    mask = ro.response_mask.bool()
    budget = MICRO * (PROMPT + RESPONSE)
    layouts = {"padded": Batching(MICRO), "packed": Batching(MICRO, budget)}
    engines = {name: _engine(facts, path, dtype) for name in layouts}
    logp, losses = {}, {}
    adv = torch.linspace(-1, 1, BATCH, device="cuda").unsqueeze(1) * ro.response_mask
    cfg = ActorConfig(ppo_mini_batch_size=BATCH)
    for name, bat in layouts.items():
        infer_logprobs(engines[name], ro, facts.vocab_size, bat.reset())  # warm-up (kernels, allocator)
        logp[name], t_inf = _timed(lambda: infer_logprobs(engines[name], ro, facts.vocab_size, bat.reset()))
        real, computed = bat.counts()
        m, t_upd = _timed(lambda: actor_update(engines[name], Experience(ro, logp[name], adv, adv), cfg, facts.vocab_size,
                                               seqs_per_update=BATCH, micro=bat.reset()).metrics)
        losses[name] = m["actor/pg_loss"]
        print(f"\n{name} {dtype}: infer {t_inf * 1e3:.1f} ms ({real / t_inf:,.0f} real tok/s), update "
              f"{t_upd * 1e3:.1f} ms, padding {1 - real / computed:.1%}")
    d = (logp["packed"] - logp["padded"]).abs()[mask]
    print(f"|packed - padded| log-prob: mean {d.mean():.2e} max {d.max():.2e}; pg_loss {losses['packed']:.6f} vs "
          f"{losses['padded']:.6f}")
    if dtype == torch.float32:
        assert d.max() <= 1e-4 and abs(losses["packed"] - losses["padded"]) <= 1e-5
    else:  # bf16: other GEMM shapes round differently
        assert d.mean() <= 2e-2 and d.max() <= 0.5 and abs(losses["packed"] - losses["padded"]) <= 1e-2


def test_rollout_vs_training_logprob_gap_in_bf16(setup):
    """rollout/logprob_diff_mean|max on a bf16 rollout (KV-cache decoding with CUDA graphs vs one packed
    training forward, same weights): printed, and small on average."""
    from trinity.rollout.reference import reference_generate
    from trinity.rollout.types import SamplingParams
    from trinity.trainer.recipes.rl import _logprob_gap
    from trinity.trainer.recipes.rollout_forward import Batching, infer_logprobs

    facts, path = setup
    engine = _engine(facts, path, torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    prompts = [list(range(3 + i, 40 + i)) for i in range(32)]
    ro = reference_generate(engine.modules[0], prompts, SamplingParams(max_new_tokens=128), vocab_size=facts.vocab_size,
                  pad_id=0, generator=g)
    for name, bat in (("padded", Batching(MICRO)), ("packed", Batching(MICRO, MICRO * ro.tokens.shape[1]))):
        gap = _logprob_gap(ro.logprobs, infer_logprobs(engine, ro, facts.vocab_size, bat), ro.response_mask)
        print(f"\nbf16 rollout vs {name} training log-probs: mean {gap['rollout/logprob_diff_mean']:.2e}, "
              f"max {gap['rollout/logprob_diff_max']:.2e}")
        assert 0 < gap["rollout/logprob_diff_mean"] <= 0.05, gap
