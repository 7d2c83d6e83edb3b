"""The fused sampler (trinity.rollout.sampler) under Triton's interpreter on the CPU: greedy tokens and
log-probs equal torch's, sampled tokens follow softmax(x / T), and a row's draw depends on its key only
(not on the batch it runs in, nor on how its vocabulary is split over programs).

Triton reads TRITON_INTERPRET when a kernel is defined, so the checks run in a child process that sets it
before importing the module; skipped where Triton is not installed (the CPU wheel of torch does not
bring it; tests/gpu/test_rollout_continuous_gpu.py runs the kernel on a GPU). The first-use verdict
that every decode kernel shares needs no Triton."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import json, sys
    import torch
    from trinity.rollout import sampler as S
    from trinity.rollout.types import SamplingParams

    torch.manual_seed(0)
    out = {}
    dev = torch.device("cpu")
    out["available"] = S.available(dev, SamplingParams(temperature=1.0))
    out["top_p_falls_back"] = not S.available(dev, SamplingParams(temperature=1.0, top_p=0.9))

    # greedy and log-probs against torch; the padded columns (huge values) must be ignored
    vocab = 3000
    logits = torch.randn(6, vocab + 72) * 4
    logits[:, vocab:] = 1e4
    keys = torch.arange(6)
    seed = torch.tensor([7])
    ref = torch.log_softmax(logits[:, :vocab], -1)
    tok, logp = S.fused_sample(logits, vocab, 0.0, seed, keys)
    out["greedy_equal"] = torch.equal(tok, ref.argmax(-1))
    out["greedy_logp_err"] = float((logp - ref.gather(-1, tok[:, None])[:, 0]).abs().max())
    hot, hlogp = S.fused_sample(logits, vocab, 1.0, seed, keys)
    out["hot_in_vocab"] = bool((hot >= 0).all() and (hot < vocab).all())
    out["hot_logp_err"] = float((hlogp - ref.gather(-1, hot[:, None])[:, 0]).abs().max())
    # `programs` 32 instead of an H100's 264: the same split rule with 40 rows instead of 300 (the
    # interpreter runs one program at a time, ~60 ms each here)
    tune = {"programs": 32}
    out["splits"] = [S.splits_for(1, 2100, 32), S.splits_for(40, 2100, 32)]

    # a row's draw depends on (seed, key, logits) only: alone (its vocabulary split over programs) or
    # among 40 rows (one program per row) it draws the same token
    many = torch.randn(40, 2100) * 2
    keys = torch.arange(40) * 1000 + 3
    batch, _ = S.fused_sample(many, 2100, 1.0, seed, keys, tune)
    alone = [int(S.fused_sample(many[i:i + 1], 2100, 1.0, seed, keys[i:i + 1], tune)[0]) for i in (0, 21, 39)]
    out["same_alone"] = alone == [int(batch[i]) for i in (0, 21, 39)]
    other, _ = S.fused_sample(many, 2100, 1.0, torch.tensor([8]), keys, tune)
    out["other_seed_differs"] = float((other != batch).float().mean())

    # frequencies of 250 draws of one row (250 keys) against softmax(x / T)
    small = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5, -0.5, 0.2]])
    rows = 250
    for t in (1.0, 0.6):
        tok, _ = S.fused_sample(small.repeat(rows, 1), 8, t, seed, torch.arange(rows))
        freq = torch.bincount(tok, minlength=8).double() / rows
        p = torch.softmax(small[0].double() / t, -1)
        z = ((freq - p).abs() / (p * (1 - p) / rows).sqrt()).max()
        out[f"z_{t}"] = float(z)
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.slow
def test_fused_sampler_under_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=240)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads(line[len("RESULT "):])
    assert res["available"] and res["top_p_falls_back"], res
    assert res["greedy_equal"] and res["greedy_logp_err"] < 1e-5, res
    assert res["hot_in_vocab"] and res["hot_logp_err"] < 1e-5, res
    assert res["splits"] == [2, 1], res  # alone, the row's vocabulary was split over two programs
    assert res["same_alone"], res
    assert res["other_seed_differs"] > 0.5, res
    # 4.5 standard errors on the worst of 8 categories: a biased sampler (no Gumbel noise, a wrong
    # temperature) is off by tens
    assert res["z_1.0"] < 4.5 and res["z_0.6"] < 4.5, res


def test_first_use_verdict_warns_with_the_reason():
    """A kernel whose first-use check fails (a difference, or a Triton error) is not used, and the warning
    names why (docs/troubleshooting.md lists these warnings)."""
    import warnings

    from trinity.rollout.first_use import verdict

    msg = "fused sampler disabled ({reason}); the rollout samples with the torch ops"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert verdict(lambda: None, msg)
        assert not verdict(lambda: "log-prob differs from log_softmax by 3.00e-02", msg)
        assert not verdict(lambda: 1 // 0, msg)
    texts = [str(w.message) for w in seen]
    assert texts == ["fused sampler disabled (log-prob differs from log_softmax by 3.00e-02); the rollout samples with the torch ops",
                     "fused sampler disabled (ZeroDivisionError: integer division or modulo by zero); the rollout samples with the torch ops"]
