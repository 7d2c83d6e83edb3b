"""The decode step's Triton kernels alone, against their floors: the split-KV attention over launch
settings, and the fused sampler against the torch ops it replaced.

    python benchmarks/decode_kernels.py                       # both, on CUDA
    python benchmarks/decode_kernels.py --what sampler --rows 1 16 64 256 512
    python benchmarks/decode_kernels.py --what layers --shape 0.5b --rows 8 32 128 512 --ctx 700
    python benchmarks/decode_kernels.py --what prefix --shape 7b --rows 64 256 512 --ctx 150

Attention: one layer's decode attention of `rows` rows whose live contexts are drawn around `--ctx`
(uniform in [ctx/2, 3 ctx/2]); floor = the live keys and values read once / the copy rate measured in
this run (reads and writes counted). Each setting (keys per block, warps, pipeline stages, keys per split
when rows are few, the row x group count from which a row is one program) is a row of the table; "default"
is what the engine runs. Sampler: tokens and log-probs of `rows` rows of [rows, vocab] bf16 logits at
temperature 1 and 0, fused kernel vs the torch ops (fp32 copy, softmax, multinomial, log-softmax, gather);
floor = the logits read once. Layers: a decode step's attention part (RoPE, the cache store, the
attention and the merge of its splits) as the engine runs it, for each layer of the shape, in one CUDA
graph, so that the gaps between kernels count: RoPE in its own kernel against RoPE in the attention kernel. Prefix:
the same over rows that are `--n` samples of a `--prompt-len`-token prompt, each sample reading its own
copy of the prompt's keys against all reading one (the engine's shared prompt keys). Times are
medians of triton.testing.do_bench (CUDA events).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate import SHAPES, bandwidth  # noqa: E402


DEVICE = "cuda"


def _bench(fn) -> float:
    if DEVICE != "cuda":  # a smoke run (TRITON_INTERPRET=1 --device cpu): one timed call
        import time

        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3


def attention(args, bw: float) -> None:
    from trinity.rollout.decode_attention import decode_attention

    shape = SHAPES[args.shape]
    groups, heads = shape["num_key_value_heads"], shape["num_attention_heads"]
    d, per = shape["hidden_size"] // heads, heads // groups
    cache_len = args.cache_len
    print(f"\nattention, shape {args.shape}: {groups} groups x {per} query heads, head dim {d}, cache {cache_len}")
    print("| rows | mean ctx | setting | us | GB/s | % of floor |")
    print("|---|---|---|---|---|---|")
    settings = [("default", {})]
    for bn, nw, ns in itertools.product((64, 128), (4, 8), (2, 3, 4)):
        settings.append((f"block {bn}, warps {nw}, stages {ns}", dict(block_n=bn, num_warps=nw, num_stages=ns)))
    for rows in args.rows:
        g = torch.Generator(device="cpu").manual_seed(rows)
        ctx = torch.randint(max(1, args.ctx // 2), min(cache_len, args.ctx * 3 // 2) + 1, (rows,), generator=g)
        q = torch.randn(rows, groups, per, d, generator=g).to(DEVICE, torch.bfloat16)
        kv = [torch.randn(rows, groups, cache_len, d, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2)]
        lengths = ctx.to(DEVICE)
        floor = 2 * int(ctx.sum()) * groups * d * 2 / bw
        ref = decode_attention(q, kv[0], kv[1], lengths, cache_len, d**-0.5).float()
        results = []
        variants = settings if rows in args.sweep_rows else settings[:1]
        for name, tune in variants:
            extra = [(name, tune)]
            if rows * groups < 512 and tune:  # split mode: keys per split too
                extra = [(f"{name}, split {sp}", {**tune, "split": sp}) for sp in (256, 512)]
            for label, t in extra:
                try:
                    out = decode_attention(q, kv[0], kv[1], lengths, cache_len, d**-0.5, tune=t)
                    err = float((out.float() - ref).norm() / ref.norm())
                    if err > 2e-2:
                        print(f"| {rows} | {float(ctx.float().mean()):.0f} | {label} | wrong: rel err {err:.1e} | | |")
                        continue
                    sec = _bench(lambda: decode_attention(q, kv[0], kv[1], lengths, cache_len, d**-0.5, tune=t))
                except Exception as exc:  # a setting Triton cannot compile (shared memory)
                    print(f"| {rows} | {float(ctx.float().mean()):.0f} | {label} | failed: {type(exc).__name__} | | |")
                    continue
                results.append((sec, label))
        results.sort()
        shown = [r for r in results if r[1] == "default"] + [r for r in results[: args.top] if r[1] != "default"]
        for sec, label in shown:
            print(f"| {rows} | {float(ctx.float().mean()):.0f} | {label} | {sec * 1e6:.1f} | "
                  f"{2 * int(ctx.sum()) * groups * d * 2 / sec / 1e9:.0f} | {100 * floor / sec:.1f} |", flush=True)


def sampler(args, bw: float) -> None:
    from trinity.rollout.sampler import fused_sample
    from trinity.rollout.types import SamplingParams
    from trinity.rollout.sampler import sample

    vocab = SHAPES[args.shape]["vocab_size"]
    padded = -(-vocab // 128) * 128
    print(f"\nsampler, vocab {vocab} (padded {padded}), bf16 logits")
    print("| rows | temperature | torch ops us | fused us | speed-up | floor us |")
    print("|---|---|---|---|---|---|")
    for rows in args.rows:
        logits = (torch.randn(rows, padded, device=DEVICE) * 3).to(torch.bfloat16)
        keys = torch.arange(rows, device=DEVICE)
        seed = torch.tensor([1], device=DEVICE)
        gen = torch.Generator(device=DEVICE).manual_seed(0)
        for temp in (1.0, 0.0):
            params = SamplingParams(temperature=temp)

            def torch_ops():
                last = logits[:, :vocab].float()
                nxt = sample(last, params, gen)
                return torch.log_softmax(last, -1).gather(-1, nxt.unsqueeze(-1))

            t_torch = _bench(torch_ops)
            t_fused = _bench(lambda: fused_sample(logits, vocab, temp, seed, keys))
            floor = rows * vocab * 2 / bw  # one read of the logits at the copy's rate of bytes moved
            best = ""
            if rows in args.sweep_rows:  # launch settings: columns per block, warps, rows x splits aimed at
                timed = []
                for blk, nw, progs in itertools.product((2048, 4096), (4, 8), (264, 1056)):
                    tune = dict(block=blk, num_warps=nw, programs=progs)
                    timed.append((_bench(lambda: fused_sample(logits, vocab, temp, seed, keys, tune=tune)), tune))
                sec, tune = min(timed, key=lambda t: t[0])
                best = f" (best {sec * 1e6:.1f} us: {tune})"
            print(f"| {rows} | {temp} | {t_torch * 1e6:.1f} | {t_fused * 1e6:.1f}{best} | {t_torch / t_fused:.1f}x | "
                  f"{floor * 1e6:.1f} |", flush=True)


def layers(args, bw: float) -> None:
    from trinity.rollout.decode_attention import decode_attention, num_splits
    from trinity.rollout.decode_fused import rope_store
    from trinity.rollout.rope_triton import random_rope_table

    shape = SHAPES[args.shape]
    groups, heads, n_layers = shape["num_key_value_heads"], shape["num_attention_heads"], shape["num_hidden_layers"]
    d, per = shape["hidden_size"] // heads, heads // groups
    cache_len = args.cache_len
    print(f"\nattention part of {n_layers} decode layers, shape {args.shape}, cache {cache_len}, one CUDA graph")
    print("| rows | mean ctx | RoPE + cache store | keys per split / full grid | splits | kernels per layer | us per step | us per layer |")
    print("|---|---|---|---|---|---|---|---|")
    variants = [None] + [("split", v) for v in (args.split or [])] + [("full_grid", v) for v in (args.full_grid or [])]
    for rows, variant in itertools.product(args.rows, variants):
        g = torch.Generator(device="cpu").manual_seed(rows)
        ctx = torch.randint(max(1, args.ctx // 2), min(cache_len - 1, args.ctx * 3 // 2) + 1, (rows,), generator=g)
        qkv = torch.randn(rows, groups, per + 2, d, generator=g).to(DEVICE, torch.bfloat16)
        cos, sin = (t.to(DEVICE, torch.bfloat16) for t in random_rope_table(cache_len, d, g))
        caches = [[torch.randn(rows, groups, cache_len, d, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2)]
                  for _ in range(n_layers)]
        pos = (ctx - 1).to(DEVICE)
        lengths = ctx.to(DEVICE)
        tune = {} if variant is None else {variant[0]: variant[1]}
        splits = num_splits(rows * groups, cache_len, tune)

        def step(fused: bool):
            for k, v in caches:
                if fused:
                    decode_attention(qkv, k, v, lengths, cache_len, d**-0.5, tune=tune, rope=(cos, sin, pos))
                else:
                    decode_attention(rope_store(qkv, cos, sin, pos, k, v), k, v, lengths, cache_len, d**-0.5, tune=tune)

        for fused in ((False, True) if variant is None else (True,)):
            step(fused)  # compile outside the capture
            if DEVICE == "cuda":
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step(fused)
                sec = _bench(graph.replay)
            else:  # the CPU smoke run
                sec = _bench(lambda: step(fused))
            kernels = 1 + (not fused) + (splits > 1)
            print(f"| {rows} | {float(ctx.float().mean()):.0f} | {'in the attention kernel' if fused else 'own kernel'} | "
                  f"{'engine' if variant is None else f'{variant[0]} {variant[1]}'} | {splits} | {kernels} | {sec * 1e6:.1f} | "
                  f"{sec * 1e6 / n_layers:.2f} |", flush=True)


def prefix(args, bw: float) -> None:
    """The attention part of every layer (RoPE and the cache store in the kernel, as the engine runs it) over
    rows that are `--n` samples of prompts of `--prompt-len` tokens, each sample `--ctx` tokens past its
    prompt on average: each sample reading its own copy of the prompt's keys, against all samples of a
    prompt reading one copy (`prefix=`). The floors: every row's live keys read once, and the prompt's
    keys once per prompt."""
    from trinity.rollout.decode_attention import decode_attention

    shape = SHAPES[args.shape]
    groups, heads, n_layers = shape["num_key_value_heads"], shape["num_attention_heads"], shape["num_hidden_layers"]
    d, per = shape["hidden_size"] // heads, heads // groups
    cache_len, plen_ = args.cache_len, args.prompt_len
    print(f"\nattention part of {n_layers} decode layers, shape {args.shape}, {args.n} samples per prompt of "
          f"{plen_} tokens, cache {cache_len}, one CUDA graph")
    print("| rows | mean ctx | prompt keys | us per layer | floor us per layer | % of floor | saved |")
    print("|---|---|---|---|---|---|---|")
    for rows in args.rows:
        g = torch.Generator(device="cpu").manual_seed(rows)
        own = torch.randint(1, max(2, 2 * args.ctx), (rows,), generator=g)
        ctx = (plen_ + own).clamp(max=cache_len - 1)
        dg = torch.Generator(device=DEVICE).manual_seed(rows)
        qkv = torch.randn(rows, groups, per + 2, d, generator=dg, device=DEVICE).to(torch.bfloat16)
        from trinity.rollout.rope_triton import random_rope_table

        cos, sin = (t.to(DEVICE, torch.bfloat16) for t in random_rope_table(cache_len, d, g))
        lead = (torch.arange(rows) // args.n * args.n).to(DEVICE)
        plen = torch.full((rows,), plen_, device=DEVICE)
        caches = []
        for _ in range(n_layers):
            kv = [torch.randn(rows, groups, cache_len, d, generator=dg, device=DEVICE, dtype=torch.bfloat16) for _ in range(2)]
            for c in kv:  # every sample holds its prompt's keys (as prefill copies them)
                c[:, :, :plen_] = c.index_select(0, lead)[:, :, :plen_]
            caches.append(kv)
        pos, lengths = (ctx - 1).to(DEVICE), ctx.to(DEVICE)
        outs = {}
        times = {}
        for shared in (False, True):
            kw = dict(rope=(cos, sin, pos), prefix=(lead, plen) if shared else None)

            def step():
                return [decode_attention(qkv, k, v, lengths, cache_len, d**-0.5, **kw) for k, v in caches]

            outs[shared] = step()  # compile outside the capture
            if DEVICE == "cuda":
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
                times[shared] = _bench(graph.replay) / n_layers
            else:
                times[shared] = _bench(step) / n_layers
        same = all(torch.equal(a, b) for a, b in zip(outs[False], outs[True]))
        assert same, "shared prompt keys changed the attention's output"
        kv_bytes = groups * d * 2 * 2  # keys and values, bf16, per token and layer
        prompts = -(-rows // args.n)
        floors = {False: float(ctx.sum()) * kv_bytes / bw,
                  True: (float(ctx.sum()) - (rows - prompts) * plen_) * kv_bytes / bw}
        for shared in (False, True):
            print(f"| {rows} | {float(ctx.float().mean()):.0f} | {'one copy per prompt' if shared else 'own copy per row'} | "
                  f"{times[shared] * 1e6:.2f} | {floors[shared] * 1e6:.2f} | {100 * floors[shared] / times[shared]:.1f}% | "
                  f"{'' if not shared else f'{100 * (1 - times[True] / times[False]):.0f}%'} |", flush=True)
        del caches


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--what", default="attention,sampler")
    ap.add_argument("--shape", default="7b", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--sweep-rows", type=int, nargs="*", default=None, help="rows to sweep settings at (default: all)")
    ap.add_argument("--ctx", type=int, default=600, help="mean live context of the attention rows")
    ap.add_argument("--cache-len", type=int, default=1280)
    ap.add_argument("--n", type=int, default=8, help="prefix: samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=256, help="prefix: prompt tokens")
    ap.add_argument("--split", type=int, nargs="*", default=None, help="layers: keys per split to time besides the engine's rule")
    ap.add_argument("--full-grid", type=int, nargs="*", default=None,
                    help="layers: rows x groups from which a row is one program (no split), to time besides the engine's (trinity.rollout.decode_attention.full_grid)")
    ap.add_argument("--top", type=int, default=6, help="fastest settings shown per row count")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    args.sweep_rows = args.rows if args.sweep_rows is None else args.sweep_rows
    bw = bandwidth(torch.device(DEVICE))
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s (read + write)")
    for what in args.what.split(","):
        {"attention": attention, "sampler": sampler, "layers": layers, "prefix": prefix}[what](args, bw)


if __name__ == "__main__":
    main()
