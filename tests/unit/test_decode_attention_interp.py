"""The split-KV decode attention kernel (trinity.rollout.decode_attention) under Triton's interpreter on
the CPU: with RoPE and the cache store in the kernel (`rope=`) it gives what the separate RoPE kernel and
the attention give, bit for bit, and (fp32) both write the cache the torch ops write; with shared prompt keys
(`prefix=`) it reads them from the slot named; and the continuous engine on a tiny Qwen2
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
    from trinity.rollout.decode_fused import rope_store
    from trinity.rollout.rope_triton import random_rope_table, reference_rope_store

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

    # shared prompt keys: rows read their first plen keys from slot src (their own copies are garbage
    # here), against the kernel over caches where every row holds src's copy; with RoPE and the cache
    # store in the kernel too (decode positions are past the prompt)
    b, g, per, d, cache = 6, 2, 3, 32, 192
    src, plen = torch.tensor([0, 0, 0, 4, 4, 4]), torch.tensor([40, 40, 40, 17, 17, 17])
    q, qkv = torch.randn(b, g, per, d), torch.randn(b, g, per + 2, d)
    cos, sin = random_rope_table(cache, d)
    shared = []
    for nkeys in (torch.tensor([1, 40, 150, 17, 90, 191]), torch.tensor([41, 41, 150, 18, 90, 191])):
        for splits in (None, 1, 3):
            kv = [torch.randn(b + 1, g, cache, d) for _ in range(2)]
            fixed = [c.clone() for c in kv]
            for i in range(b):
                for c, f in zip(kv, fixed):
                    f[i, :, :plen[i]] = c[src[i], :, :plen[i]]
            rope = nkeys.min() > 17  # the second set: RoPE and the store at position nkeys - 1
            kw = dict(rope=(cos, sin, nkeys - 1)) if rope else {}
            x = qkv if rope else q
            got = decode_attention(x, *kv, nkeys, cache, d ** -0.5, splits=splits, prefix=(src, plen), **kw)
            want = decode_attention(x, *fixed, nkeys, cache, d ** -0.5, splits=splits, **kw)
            written = not rope or all(torch.equal(c[i, :, nkeys[i] - 1], f[i, :, nkeys[i] - 1])
                                      for c, f in zip(kv, fixed) for i in range(b))
            shared.append({"rope": bool(rope), "splits": splits, "equal": torch.equal(got, want),
                           "cache_written": bool(written),
                           "garbage_differs": not torch.equal(decode_attention(x.clone(), *[c.clone() for c in kv], nkeys, cache,
                                                                              d ** -0.5, splits=splits, **kw), want)})
    out["shared"] = shared

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
    from trinity.rollout.reference import reference_generate
    from trinity.rollout.types import SamplingParams
    from trinity.testing.tiny_models import make_tiny_hf_model

    path = make_tiny_hf_model("qwen2", Path(sys.argv[1]))
    facts = ModelFacts.from_hf_dir(path)
    init_parallel(device="cpu", layout=ParallelLayout(), seed=3)
    chunks = build_model(facts, MegatronConfig(), device="cpu", dtype=torch.float32)
    load_hf_weights(chunks, path, facts)
    prompts = [p for p in ([5, 9, 17, 3, 44, 2, 8, 11], [7, 1], [100, 12, 8, 60]) for _ in range(2)]
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    want = reference_generate(chunks[0], prompts, params, vocab_size=facts.vocab_size, pad_id=0)  # torch ops
    stats = RolloutStats()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = generate_continuous(chunks[0], prompts, params, vocab_size=facts.vocab_size, pad_id=0, stats=stats)
    out["engine"] = {
        "attention": stats.attention, "warnings": [str(w.message) for w in seen if "disabled" in str(w.message)],
        "tokens_equal": torch.equal(got.tokens, want.tokens),
        "logp_diff": (got.logprobs - want.logprobs).abs().max().item(),
    }
    # shared prompt keys through waves, against SDPA over each row's own copy: a prompt of 4 samples in 3
    # slots (split over two admissions), then 3 prompts of one sample; rows end at scheduled lengths. The
    # prompt's first slot ends after one token while its other samples decode on, and its slot goes to the
    # prompt's 4th sample, then to another prompt: rows still reading through that slot would read that
    # prompt's keys (the leads must move when a slot retires). Then compaction.
    from trinity.rollout.continuous import KVBudget
    from trinity.rollout.kernels import DecodeKernels
    prompts = [[5, 9, 17, 3, 44, 2, 8, 11, 23, 4]] * 4 + [[7, 1, 6], [100, 12, 8, 60, 3], [2, 90, 31, 77]]
    lengths = [1, 6, 6, 2, 3, 2, 3]
    runs = {}
    for name, kernels in (("shared", DecodeKernels()), ("sdpa", DecodeKernels(split_kv=False))):
        runs[name] = (RolloutStats(),)
        runs[name] += (generate_continuous(chunks[0], prompts, params, vocab_size=facts.vocab_size, pad_id=0,
                                           budget=KVBudget(max_num_seqs=3), response_lengths=lengths, stats=runs[name][0],
                                           kernels=kernels),)
    (s_stats, s_out), (d_stats, d_out) = runs["shared"], runs["sdpa"]
    out["waves"] = {
        "attention": s_stats.attention, "sdpa_attention": d_stats.attention, "waves": s_stats.waves,
        "tokens_equal": torch.equal(s_out.tokens, d_out.tokens), "mask_equal": torch.equal(s_out.response_mask, d_out.response_mask),
        "lengths": s_out.response_mask.sum(1).tolist(), "logp_diff": (s_out.logprobs - d_out.logprobs).abs().max().item(),
        "read_kv": s_stats.read_kv_tokens, "live_kv": s_stats.live_kv_tokens, "sdpa_read_kv": d_stats.read_kv_tokens,
        "sdpa_live_kv": d_stats.live_kv_tokens,
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
    # shared prompt keys: the kernel reads them from slot src (the same output as over copies of them, bit for
    # bit; over the garbage copies without sharing the output differs), and stores the step's key and value
    assert len(res["shared"]) == 6
    for c in res["shared"]:
        assert c["equal"] and c["cache_written"] and c["garbage_differs"], c
    # the engine took these kernels (their first-use checks passed: no "disabled" warning), and gives the
    # static batch's greedy tokens and log-probs (fp32); its prompts have two samples each, which share keys
    eng = res["engine"]
    assert eng["attention"] == "triton split-KV + fused RoPE/SwiGLU, shared prompt keys" and not eng["warnings"], eng
    assert eng["tokens_equal"] and eng["logp_diff"] < 1e-5, eng
    # through waves, retirements and compaction: SDPA's tokens and log-probs (each row reads its own copy),
    # with the scheduled lengths; the prompts' keys counted once per step where shared
    w = res["waves"]
    assert w["attention"].endswith(", shared prompt keys") and w["sdpa_attention"].startswith("sdpa"), w
    assert w["waves"] >= 4 and w["lengths"] == [1, 6, 6, 2, 3, 2, 3], w
    assert w["tokens_equal"] and w["mask_equal"] and w["logp_diff"] < 1e-5, w
    assert w["read_kv"] < w["live_kv"] and w["sdpa_read_kv"] == w["sdpa_live_kv"] == w["live_kv"], w


def test_split_threshold_and_its_override():
    """num_splits: one program per row from 128 rows x groups (the engine's rule), else the cache length
    over 256-key splits; `tune`'s full_grid moves the threshold (the engine passes
    DecodeKernels.full_grid, for whole-rollout comparisons; benchmarks their own)."""
    from trinity.rollout.decode_attention import full_grid, num_splits
    from trinity.rollout.kernels import DecodeKernels

    assert full_grid() == 128 == DecodeKernels().full_grid and full_grid({"full_grid": 256}) == 256
    assert num_splits(128, 1280) == 1 and num_splits(384, 1088) == 1 and num_splits(64, 1088) == 5
    wide = {"full_grid": 512}
    assert full_grid(wide) == 512
    assert num_splits(512, 1088, wide) == 1 and num_splits(384, 1088, wide) == 5 and num_splits(128, 1280, wide) == 5
    assert num_splits(384, 1088, {"full_grid": 128}) == 1 and num_splits(64, 1088, {"split": 512}) == 3
