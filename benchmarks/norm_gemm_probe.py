"""Would a fused RMSNorm + GEMM (+ SwiGLU) kernel make a tail decode step cheaper? A probe, before building it.

A tail decode step of the 0.5B model spends ~1.45 ms on ~260 small kernels, where reading its weights
takes 0.33 ms (docs/performance.md, "2026-11-26, morning"). Per layer, two RMSNorms (2.4 us each) and
the SwiGLU product (1.2 us) run as their own kernels beside the GEMMs that read their outputs. Here one
Triton kernel computes, for M <= 128 rows,

    y = rms_norm(x, g) @ W^T (+ bias)                 (the QKV projection), or
    y = silu(rms_norm(x, g) @ Wg^T) * (rms_norm(x, g) @ Wu^T)   (gate/up + SwiGLU),

with the norm folded into the GEMM: (x * g) @ W^T accumulated in fp32, then each row scaled by
rsqrt(mean(x^2) + eps), which the same pass over x computes. It is timed against the torch ops the
decoder runs today (F.rms_norm, F.linear, the fused SwiGLU kernel's torch equivalent), each as a CUDA
graph of 24 layers' worth of calls, so launch gaps count as they do in a decode step.

    python benchmarks/norm_gemm_probe.py --shape 0.5b --rows 8 32 128
    TRITON_INTERPRET=1 python benchmarks/norm_gemm_probe.py --check-only   # the CPU check of the kernel
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate import SHAPES, geometry, graph_ms  # noqa: E402  (the benchmarks' Qwen2 shapes, graph timing)

EPS = 1e-6


@triton.jit
def _rms_gemm_kernel(X, G, W, B, Y, M, N, K, sxm, swn, sym, eps,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, PRECISION: tl.constexpr):
    """Program n: output columns [n * BLOCK_N, +BLOCK_N) of every row. SWIGLU: W holds [gate; up] (2N
    rows), the output is silu(gate) * up."""
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        x = tl.load(X + rows[:, None] * sxm + kk[None, :], mask=(rows[:, None] < M) & (kk[None, :] < K), other=0.0)
        xf = x.to(tl.float32)
        sumsq += tl.sum(xf * xf, 1)
        g = tl.load(G + kk, mask=kk < K, other=0.0).to(tl.float32)
        xg = (xf * g[None, :]).to(x.dtype)
        w = tl.load(W + cols[None, :] * swn + kk[:, None], mask=(cols[None, :] < N) & (kk[:, None] < K), other=0.0)
        acc += tl.dot(xg, w, input_precision=PRECISION)
        if SWIGLU:
            w2 = tl.load(W + (cols[None, :] + N) * swn + kk[:, None], mask=(cols[None, :] < N) & (kk[:, None] < K),
                         other=0.0)
            acc2 += tl.dot(xg, w2, input_precision=PRECISION)
    r = 1.0 / tl.sqrt(sumsq / K + eps)
    acc = acc * r[:, None]
    if HAS_BIAS:
        acc += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if SWIGLU:
        acc2 = acc2 * r[:, None]
        acc = acc / (1.0 + tl.exp(-acc)) * acc2
    tl.store(Y + rows[:, None] * sym + cols[None, :], acc.to(Y.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def rms_gemm(x: torch.Tensor, g: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, swiglu: bool = False,
             block_n: int = 32, block_k: int = 128, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0] // 2 if swiglu else w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = max(16, triton.next_power_of_2(m))
    launch = {} if os.environ.get("TRITON_INTERPRET") == "1" else {"num_warps": num_warps, "num_stages": num_stages}
    _rms_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, g, w, bias if bias is not None else y, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), EPS,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None, SWIGLU=swiglu,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **launch)
    return y


def torch_ops(x, g, w, bias=None, swiglu=False):
    """What the decoder's lean path runs today (trinity.rollout.slots._lean_layer / _lean_rest): on CUDA
    its SwiGLU is one Triton kernel (trinity.rollout.decode_fused.silu_mul)."""
    y = F.linear(F.rms_norm(x, (x.shape[-1],), g, EPS), w, bias)
    if swiglu and y.is_cuda:
        from trinity.rollout.decode_fused import silu_mul

        return silu_mul(y)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y


def check(device: torch.device, dtype: torch.dtype) -> float:
    """Largest error of the kernel against the torch ops in fp32 arithmetic, relative to the output's scale."""
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for m, k, n, bias, swiglu in ((3, 40, 24, True, False), (17, 64, 40, False, True)):
        x = torch.randn(m, k, generator=gen).to(device, dtype)
        g = (1 + 0.1 * torch.randn(k, generator=gen)).to(device, dtype)
        w = (0.1 * torch.randn(2 * n if swiglu else n, k, generator=gen)).to(device, dtype)
        b = torch.randn(n, generator=gen).to(device, dtype) if bias else None
        got = rms_gemm(x, g, w, b, swiglu, block_n=16, block_k=32).float()
        want = torch_ops(x.float(), g.float(), w.float(), None if b is None else b.float(), swiglu)
        worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
    return worst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--layers", type=int, default=24, help="calls per timed graph (one decode step's worth)")
    ap.add_argument("--check-only", action="store_true")
    args = ap.parse_args()
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    device = torch.device("cpu" if interpret else "cuda")
    err = check(device, torch.float32)
    print(f"kernel vs torch ops, fp32: max relative error {err:.2e}")
    assert err < 1e-4, err
    if args.check_only or interpret:
        return
    print(f"bf16: max relative error {check(device, torch.bfloat16):.2e}")
    h, ffn, _, heads, groups, d, _ = geometry(args.shape)
    qkv_n = (heads + 2 * groups) * d
    ws = {"qkv": torch.randn(qkv_n, h, device=device, dtype=torch.bfloat16) * 0.02,
          "bias": torch.randn(qkv_n, device=device, dtype=torch.bfloat16) * 0.02,
          "fc1": torch.randn(2 * ffn, h, device=device, dtype=torch.bfloat16) * 0.02,
          "g": torch.ones(h, device=device, dtype=torch.bfloat16)}
    configs = [dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
               for bn in (32, 64) for bk in (64, 128) for nw in (4,) for ns in (2, 4)]

    def graph_time(fn, reps: int = 50) -> float:
        """us per call: `args.layers` calls captured in one graph, replayed `reps` times."""
        return graph_ms(lambda: [fn() for _ in range(args.layers)], reps) * 1e3 / args.layers

    print(f"\nshape {args.shape}: us per layer's call, {args.layers} calls per CUDA graph (H100-class GPU)")
    print("| rows | what | torch ops (rms_norm + GEMM [+ SwiGLU]) | fused kernel, best config | config | weights MB |")
    print("|---|---|---|---|---|---|")
    for m in args.rows:
        x = torch.randn(m, h, device=device, dtype=torch.bfloat16)
        for what, w, bias, swiglu in (("QKV + bias", ws["qkv"], ws["bias"], False), ("gate/up + SwiGLU", ws["fc1"], None, True)):
            base = graph_time(lambda: torch_ops(x, ws["g"], w, bias, swiglu))
            best, best_cfg = float("inf"), None
            for cfg in configs:
                try:
                    t = graph_time(lambda: rms_gemm(x, ws["g"], w, bias, swiglu, **cfg), reps=20)
                except Exception:  # a config Triton cannot build (shared memory): skipped
                    continue
                if t < best:
                    best, best_cfg = t, cfg
            diff = (rms_gemm(x, ws["g"], w, bias, swiglu, **best_cfg).float() - torch_ops(x, ws["g"], w, bias, swiglu).float())
            print(f"| {m} | {what} | {base:.2f} | {best:.2f} | {best_cfg} (max abs diff {diff.abs().max().item():.1e}) | "
                  f"{w.numel() * 2 / 1e6:.1f} |", flush=True)


if __name__ == "__main__":
    main()
