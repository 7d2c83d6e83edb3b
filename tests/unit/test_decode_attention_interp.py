"""The split-KV decode attention kernel (trinity.rollout.decode_attention) under Triton's interpreter on
the CPU: with RoPE and the cache store in the kernel (`rope=`) it gives what the separate RoPE kernel and
the attention give, bit for bit, and (fp32) both write the cache the torch ops write; and the continuous engine on a tiny Qwen2
(fp32) with these kernels and the fused SwiGLU gives the static batch's greedy tokens (torch ops) and its
log-probs within 1e-5. The engine part is the CPU test of the GPU decode path's wiring (which kernel gets
which tensors); CUDA graphs are GPU-only.

Triton reads TRITON_INTERPRET when a kernel is defined, so the checks run in a child process that sets it
first; skipped where Triton is not installed (tests/gpu/test_rollout_continuous_gpu.py runs the kernels on
a GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import json
    import torch
    import torch.nn.functional as F
    from trinity.rollout.decode_attention import decode_attention
    from trinity.rollout.decode_fused import random_rope_table, reference_rope_store, rope_store

    torch.manual_seed(0)
    cases = []
    # (rows, groups, query heads per group, head dim, cache length, splits): the default split count of a
    # short row set, one split, and three
    # (bf16: one case, for the roundings; the interpreter's bf16 attention is not compared with SDPA)
    for dtype, shapes in ((torch.float32, ((3, 2, 2, 32, 192, None), (2, 1, 4, 16, 128, 1), (5, 2, 3, 32, 320, 3))),
                          (torch.bfloat16, ((5, 2, 3, 32, 320, 3),))):
        for b, g, per, d, cache, splits in shapes:
            qkv = torch.randn(b, g, per + 2, d).to(dtype)
            cos, sin = (t.to(dtype) for t in random_rope_table(cache, d))
            pos = torch.randint(0, cache - 1, (b,))
            pos[0] = 0
            nkeys = pos + 1
            caches = [torch.randn(b + 1, g, cache, d).to(dtype) for _ in range(2)]
            mine, ref_caches = [c.clone() for c in caches], [c.clone() for c in caches]
            q = rope_store(qkv, cos, sin, pos, *caches)  # the separate kernels
            sep = decode_attention(q, caches[0], caches[1], nkeys, cache, d ** -0.5, splits=splits)
            fused = decode_attention(qkv, mine[0], mine[1], nkeys, cache, d ** -0.5, splits=splits, rope=(cos, sin, pos))
            # the torch ops' RoPE and cache (both kernels share one RoPE definition: this is the independent
            # check of its roundings), and SDPA over them
            rq = reference_rope_store(qkv, cos, sin, pos, *ref_caches)
            ref = torch.cat([F.scaled_dot_product_attention(rq[i:i + 1].float(), ref_caches[0][i:i + 1, :, :n].float(),
                                                            ref_caches[1][i:i + 1, :, :n].float(), scale=d ** -0.5)
                             for i, n in enumerate(nkeys.tolist())])
            cases.append({
                "case": f"{dtype} b={b} g={g} per={per} d={d} cache={cache} splits={splits}",
                "fused_equal": torch.equal(fused, sep),
                "keys_equal": torch.equal(mine[0], caches[0]), "values_equal": torch.equal(mine[1], caches[1]),
                "torch_ops_equal": torch.equal(q, rq) and all(torch.equal(a, r) for a, r in zip(caches, ref_caches)),
                "sdpa_err": ((fused.float() - ref).norm() / ref.norm()).item(),
            })
    out = {"cases": cases}

    # the engine on a tiny Qwen2 with these kernels, against the static batch (torch ops)
    import sys, warnings
    from pathlib import Path
    from trinity.config.megatron import MegatronConfig
    from trinity.convert.builtin import load_hf_weights
    from trinity.distributed.layout import ParallelLayout
    from trinity.distributed.parallel import init_parallel
    from trinity.models.build import build_model
    from trinity.models.facts import ModelFacts
    from trinity.rollout.continuous import RolloutStats, generate_continuous
    from trinity.rollout.generate import SamplingParams, generate
    from trinity.testing.tiny_models import make_tiny_hf_model

    path = make_tiny_hf_model("qwen2", Path(sys.argv[1]))
    facts = ModelFacts.from_hf_dir(path)
    init_parallel(device="cpu", layout=ParallelLayout(), seed=3)
    chunks = build_model(facts, MegatronConfig(), device="cpu", dtype=torch.float32)
    load_hf_weights(chunks, path, facts)
    prompts = [p for p in ([5, 9, 17, 3, 44, 2, 8, 11], [7, 1], [100, 12, 8, 60]) for _ in range(2)]
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    want = generate(chunks[0], prompts, params, vocab_size=facts.vocab_size, pad_id=0)  # torch ops
    stats = RolloutStats()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = generate_continuous(chunks[0], prompts, params, vocab_size=facts.vocab_size, pad_id=0, stats=stats)
    out["engine"] = {
        "attention": stats.attention, "warnings": [str(w.message) for w in seen if "disabled" in str(w.message)],
        "tokens_equal": torch.equal(got.tokens, want.tokens),
        "logp_diff": (got.logprobs - want.logprobs).abs().max().item(),
    }
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.slow
def test_fused_rope_equals_the_separate_kernels_and_the_engine_the_static_batch(tmp_path):
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=280)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads(line[len("RESULT "):])
    for c in res["cases"]:
        assert c["fused_equal"], c
        assert c["keys_equal"] and c["values_equal"], c
        # the interpreter's bf16 (its roundings and dots) is not the GPU's: tests/gpu compares bf16
        if "float32" in c["case"]:
            assert c["torch_ops_equal"], c
            assert c["sdpa_err"] < 1e-5, c
    # the engine took these kernels (their first-use checks passed: no "disabled" warning), and gives the
    # static batch's greedy tokens and log-probs (fp32)
    eng = res["engine"]
    assert eng["attention"] == "triton split-KV + fused RoPE/SwiGLU" and not eng["warnings"], eng
    assert eng["tokens_equal"] and eng["logp_diff"] < 1e-5, eng
