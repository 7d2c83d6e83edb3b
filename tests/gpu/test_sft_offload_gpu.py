"""SFT optimizer_offload on one GPU (bf16): the optimizer lives in host memory, the update matches the GPU
optimizer's, and the GPU holds 12 bytes per parameter less.

Run on a GPU machine: `python -m pytest tests/gpu/test_sft_offload_gpu.py -q -s` (prints step times and memory).
"""

from __future__ import annotations

import gc
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def setup(qwen2_small_cuda):
    return qwen2_small_cuda


def _batches(step: int, vocab: int) -> list:
    from trinity.trainer.recipes.sft import TokenRows

    g = torch.Generator().manual_seed(step)
    out = []
    for _ in range(2):
        tokens = torch.randint(1, vocab, (2, 512), generator=g)
        out.append(TokenRows(tokens, torch.arange(512).expand(2, -1), torch.zeros(2, 512, dtype=torch.long),
                             tokens.roll(-1, 1), torch.ones(2, 512), torch.device("cuda")))
    return out


def _run(facts, path, distributed: bool, on_host: bool, steps: int = 4):
    from trinity.config.megatron import MegatronConfig
    from trinity.config.roles import Role
    from trinity.config.schema import OptimConfig
    from trinity.convert.builtin import load_hf_weights
    from trinity.models.build import build_model
    from trinity.trainer.engine import RoleEngine
    from trinity.trainer.recipes.sft import train_step

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    m = MegatronConfig(use_distributed_optimizer=distributed, optimizer_offload=on_host)
    chunks = build_model(facts, m, device="cuda", dtype=torch.bfloat16)
    load_hf_weights(chunks, path, facts)
    engine = RoleEngine(Role.actor, chunks, m, OptimConfig(lr=1e-4, weight_decay=0.1, clip_grad=1.0),
                        dtype=torch.bfloat16, total_steps=10, optimizer_on_host=on_host)
    out, times = [], []
    for s in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out.append(train_step(engine, _batches(s, facts.vocab_size), loss_tokens=2048, device=torch.device("cuda"),
                              vocab_size=facts.vocab_size))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    held = torch.cuda.memory_allocated() - base
    peak = torch.cuda.max_memory_allocated() - base
    params = sum(p.numel() for p in engine.modules[0].parameters())
    host_s = engine.host.last_step_s if engine.host is not None else 0.0
    del engine, chunks
    return out, held, peak, params, times, host_s


@pytest.mark.parametrize("distributed", [True, False])
def test_sft_optimizer_offload_same_update_less_gpu_memory(setup, distributed):
    facts, path = setup
    plain, held0, peak0, params, t0, _ = _run(facts, path, distributed, on_host=False)
    moved, held1, peak1, _, t1, host_s = _run(facts, path, distributed, on_host=True)
    print(f"\ndistributed={distributed} params {params / 1e6:.1f} M: held {held0 / 2**30:.3f} -> {held1 / 2**30:.3f} GiB, "
          f"peak {peak0 / 2**30:.3f} -> {peak1 / 2**30:.3f} GiB, step {min(t0):.3f} -> {min(t1):.3f} s "
          f"(host step {host_s:.3f} s); losses {[round(x, 4) for x, _ in plain]} vs {[round(x, 4) for x, _ in moved]}")
    for (l0, g0), (l1, g1) in zip(plain, moved):
        # fused AdamW on the CPU vs on the GPU: the same math, rounding differs (the loss of step 0 is exact)
        assert l1 == pytest.approx(l0, rel=2e-3) and g1 == pytest.approx(g0, rel=2e-2)
    assert plain[0][0] == moved[0][0] and plain[-1][0] < plain[0][0]
    # the GPU keeps weights (2) + fp32 grads (4) per parameter, no fp32 master weights or Adam moments (12;
    # measured on an H100: 12.0 without, 12.55 with the distributed optimizer, whose shards are padded)
    saved = held0 - held1
    assert 12 * params * 0.98 <= saved <= 13 * params, (saved, 12 * params)
    assert peak1 < peak0 - 10 * params
