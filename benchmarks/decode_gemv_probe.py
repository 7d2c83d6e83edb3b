"""Would few-row GEMV kernels that prefetch their weights (and launch before the kernel they follow ends),
or L2 prefetches beside the engine's own kernels, make a tail decode step cheaper? A probe, before
building either into the engine. (Measured 2026-11-26 night: neither does, but a GEMV with the weights as
the first operand beats cuBLAS at a few rows; docs/performance.md.)

A decode step of every layer of a shape, at a few rows, captured as one CUDA graph and replayed:
- `torch ops`: what the engine's lean layer runs today (`trinity.rollout.slots.SlotDecoder._lean_layer`):
  F.rms_norm, F.linear (+ bias) for QKV, the split-KV attention with RoPE and the cache store, the
  output projection folded into `addmm_`, F.rms_norm, F.linear for gate/up, the SwiGLU kernel and
  `addmm_` for down; the final norm and the LM head.
- `torch ops + L2 prefetch`: the same kernels, and on a second stream of the same graph one small
  kernel per layer that asks for weights in L2 (`cp.async.bulk.prefetch.L2`) before their GEMMs run:
  layer i's gate/up and down and layer i+1's QKV and output projection at layer i's start
  (`mlp+next`), or all of layer i+1 (`next`); optionally at most `limit` bytes of each tensor.
- `gemv`: the same step in four Triton kernels per layer (below: RMSNorm folded into the QKV and
  gate/up kernels, with the QKV bias and the SwiGLU product in their epilogues; the output and down
  projections write split-K partial sums that the next norm kernel adds into the residual stream, so
  no split-K reduce and no residual-add kernel), with and without the L2 prefetch of each kernel's
  own weights before it waits for the kernel before it (`griddepcontrol.wait`), and with and without
  programmatic dependent launch (PDL: a kernel starts once every program of the one before it runs).

`--sweep` times each projection alone instead: cuBLAS against a GEMV that takes the weights as the matrix
unit's first operand (`_gemv_t_kernel`, 64-128 weight rows per program) and against the kernels above.

Every layer has its own weights (a step reads them all from memory, as a real one does). The attention
reads a cache of `--ctx` keys per row. The two paths' logits are compared (bf16 rounding differs).

    python benchmarks/decode_gemv_probe.py --shape 0.5b --rows 1 8 32
    python benchmarks/decode_gemv_probe.py --shape 7b --rows 32 64 --no-gemv
    python benchmarks/decode_gemv_probe.py --sweep --shape 0.5b --rows 1 8 32   # each projection alone
    TRITON_INTERPRET=1 python benchmarks/decode_gemv_probe.py --check-only   # the kernels' CPU check
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
from generate import geometry, graph_ms  # noqa: E402  (the benchmarks' Qwen2 shapes, graph timing)

from trinity.rollout.decode_attention import decode_attention  # noqa: E402
from trinity.rollout.decode_fused import random_rope_table, silu_mul  # noqa: E402

EPS = 1e-6
BLOCK_M_MAX = 32  # rows one program computes


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


HAS_GDC = False
try:  # grid dependency control (programmatic dependent launch): Triton 3.3+
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_GDC = True
except ImportError:  # pragma: no cover - older Triton: the kernels launch without PDL

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


@triton.jit
def _prefetch_rows(W, row0, rows_valid, row_stride, col0, ROWS: tl.constexpr, PIECES: tl.constexpr,
                   PIECE_BYTES: tl.constexpr, ESIZE: tl.constexpr):
    """Ask for W[row0 : row0 + ROWS, col0 : col0 + PIECES * PIECE_BYTES / esize] in L2: one bulk prefetch
    per (row, piece), rows past `rows_valid` clamped to the last (a repeated request, never a
    read out of bounds)."""
    r = tl.minimum(row0 + tl.arange(0, ROWS), rows_valid - 1)
    base = W.to(tl.int64) + (r.to(tl.int64) * row_stride + col0) * ESIZE
    addr = base[:, None] + tl.arange(0, PIECES)[None, :].to(tl.int64) * PIECE_BYTES
    size = tl.full(addr.shape, PIECE_BYTES, tl.int32)
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
                              "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _residual(X, P, rows, kk, xm, s_x, M, K, NPART: tl.constexpr):
    """x[rows, kk] + the NPART partial sums P[:, rows, kk], rounded to x's dtype once (as `addmm_` rounds)."""
    x = tl.load(X + rows[:, None] * s_x + kk[None, :], mask=xm, other=0.0)
    if NPART > 0:
        xf = x.to(tl.float32)
        for p in tl.static_range(NPART):
            xf += tl.load(P + (p * M + rows[:, None]) * K + kk[None, :], mask=xm, other=0.0)
        x = xf.to(X.dtype.element_ty)
    return x


@triton.jit
def _norm_gemv_kernel(X, P, G, W, B, Y, XOUT, M, N, K, eps, s_x, s_y,
                      NPART: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PREFETCH: tl.constexpr, PIECES: tl.constexpr, PIECE_BYTES: tl.constexpr,
                      ESIZE: tl.constexpr, PDL: tl.constexpr):
    """Program n: output columns [n * BLOCK_N, +BLOCK_N) of every row of
    rms_norm(x + sum(parts)) @ W^T (+ bias), or with SWIGLU (W = [gate; up], 2N rows)
    silu(gate) * up. Program 0 writes x + sum(parts) to XOUT."""
    pid = tl.program_id(0)
    n0 = pid * BLOCK_N
    if PREFETCH:
        _prefetch_rows(W, n0, N, K, 0, BLOCK_N, PIECES, PIECE_BYTES, ESIZE)
        if SWIGLU:
            _prefetch_rows(W, N + n0, 2 * N, K, 0, BLOCK_N, PIECES, PIECE_BYTES, ESIZE)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    DT = X.dtype.element_ty
    rows = tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # pass 1: the residual (x + the partial sums, rounded once) and each row's mean square
    sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        xm = (rows[:, None] < M) & (kk[None, :] < K)
        x = _residual(X, P, rows, kk, xm, s_x, M, K, NPART)
        if NPART > 0:
            if pid == 0:
                tl.store(XOUT + rows[:, None] * K + kk[None, :], x, mask=xm)
        xf = x.to(tl.float32)
        sumsq += tl.sum(xf * xf, 1)
    r = 1.0 / tl.sqrt(sumsq / K + eps)
    # pass 2: the normalized rows (rounded as F.rms_norm rounds its output) times the weights
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    wm = cols[None, :] < N
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        xm = (rows[:, None] < M) & (kk[None, :] < K)
        x = _residual(X, P, rows, kk, xm, s_x, M, K, NPART)
        g = tl.load(G + kk, mask=kk < K, other=0.0).to(tl.float32)
        xn = ((x.to(tl.float32) * r[:, None]) * g[None, :]).to(DT)
        w = tl.load(W + cols[None, :] * K + kk[:, None], mask=wm & (kk[:, None] < K), other=0.0)
        acc = tl.dot(xn, w, acc)
        if SWIGLU:
            w2 = tl.load(W + (N + cols[None, :]) * K + kk[:, None], mask=wm & (kk[:, None] < K), other=0.0)
            acc2 = tl.dot(xn, w2, acc2)
    if HAS_BIAS:
        acc += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if SWIGLU:
        gate = acc.to(DT).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(DT).to(tl.float32)
        acc = act * acc2.to(DT).to(tl.float32)
    ym = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(Y + rows[:, None] * s_y + cols[None, :], acc.to(Y.dtype.element_ty), mask=ym)


@triton.jit
def _gemv_part_kernel(A, W, P, M, N, K, s_a, KSPLIT,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PREFETCH: tl.constexpr, PIECES: tl.constexpr, PIECE_BYTES: tl.constexpr,
                      ESIZE: tl.constexpr, PDL: tl.constexpr):
    """Program (n, s): the fp32 partial sum of a @ W^T over the columns [s * KSPLIT, +KSPLIT) of K,
    for output columns [n * BLOCK_N, +BLOCK_N), into P[s]."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    k_lo = pid_k * KSPLIT
    if PREFETCH:
        _prefetch_rows(W, n0, N, K, k_lo, BLOCK_N, PIECES, PIECE_BYTES, ESIZE)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    rows = tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_lo + KSPLIT, BLOCK_K):
        kk = k0 + ks
        a = tl.load(A + rows[:, None] * s_a + kk[None, :], mask=(rows[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(W + cols[None, :] * K + kk[:, None], mask=(cols[None, :] < N) & (kk[:, None] < K), other=0.0)
        acc = tl.dot(a, w, acc)
    tl.store(P + (pid_k * M + rows[:, None]) * N + cols[None, :], acc,
             mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _prefetch_kernel(PTR, nbytes, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Ask for bytes [0, nbytes) of PTR in L2, CHUNK bytes per request (a partial last chunk is left)."""
    offs = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * CHUNK
    addr = PTR.to(tl.int64) + tl.where(offs + CHUNK <= nbytes, offs, 0)
    size = tl.full(addr.shape, CHUNK, tl.int32)
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
                              "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _gemv_t_kernel(X, W, P, M, N, K, s_x, KSPLIT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """The weights as the MMA's wide operand: program (n, s) computes W[n-block] @ X^T over the columns
    [s * KSPLIT, +KSPLIT) of K (a [BLOCK_N, BLOCK_M] tile, BLOCK_N >= 64 weight rows), into P[s]."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(pid_k * KSPLIT, (pid_k + 1) * KSPLIT, BLOCK_K):
        kk = k0 + ks
        w = tl.load(W + cols[:, None] * K + kk[None, :], mask=cols[:, None] < N, other=0.0)
        xt = tl.load(X + rows[None, :] * s_x + kk[:, None], mask=rows[None, :] < M, other=0.0)
        acc = tl.dot(w, xt, acc)
    tl.store(P + (pid_k * M + rows[None, :]) * N + cols[:, None], acc, mask=(rows[None, :] < M) & (cols[:, None] < N))


def gemv_t(x: torch.Tensor, w: torch.Tensor, splits: int, out: torch.Tensor, block_n: int = 64, block_k: int = 128,
           num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """The `splits` fp32 partial sums [splits, m, n] of x @ w^T (`_gemv_t_kernel`)."""
    m, k = x.shape
    n = w.shape[0]
    ksplit = k // splits
    assert k % splits == 0 and ksplit % block_k == 0, (k, splits, block_k)
    launch = {} if _interpreting() else {"num_warps": num_warps, "num_stages": num_stages}
    _gemv_t_kernel[(triton.cdiv(n, block_n), splits)](x, w, out, m, n, k, x.stride(0), ksplit, BLOCK_M=_block_m(m),
                                                      BLOCK_N=block_n, BLOCK_K=block_k, **launch)
    return out


def prefetch_l2(t: torch.Tensor, chunk: int = 4096, limit: int | None = None) -> None:
    """Ask the GPU to bring tensor t's bytes (the first `limit` of them) into L2 (16-byte aligned, CUDA, sm_90+)."""
    nbytes = t.numel() * t.element_size() if limit is None else min(limit, t.numel() * t.element_size())
    if nbytes < chunk or t.data_ptr() % 16:
        return
    block = 128
    _prefetch_kernel[(triton.cdiv(nbytes // chunk, block),)](t, nbytes, CHUNK=chunk, BLOCK=block, num_warps=4)


def _pieces(row_bytes: int, rows: int, threads: int) -> tuple[int, int]:
    """(pieces per row, bytes per piece) of a prefetch: about one bulk request per thread, each a multiple
    of 16 bytes that divides the row."""
    pieces = 1
    while rows * pieces * 2 <= threads and row_bytes % (pieces * 2 * 16) == 0:
        pieces *= 2
    return pieces, row_bytes // pieces


class Launch:
    """How the kernels launch on this machine: prefetch and programmatic dependent launch need a Hopper
    GPU (sm_90+) and are off under Triton's interpreter (CPU tests)."""

    def __init__(self, device: torch.device, prefetch: bool | None = None, pdl: bool | None = None) -> None:
        hopper = device.type == "cuda" and not _interpreting() and torch.cuda.get_device_capability(device)[0] >= 9
        self.prefetch = hopper if prefetch is None else (prefetch and hopper)
        self.pdl = (hopper if pdl is None else (pdl and hopper)) and HAS_GDC

    def kwargs(self, num_warps: int) -> dict:
        if _interpreting():
            return {}
        return {"num_warps": num_warps, "launch_pdl": self.pdl}


def _block_m(m: int) -> int:
    assert m <= BLOCK_M_MAX, m
    return 16 if m <= 16 else 32


def norm_gemv(x: torch.Tensor, parts: torch.Tensor | None, g: torch.Tensor, eps: float, w: torch.Tensor,
              bias: torch.Tensor | None = None, swiglu: bool = False, x_out: torch.Tensor | None = None,
              out: torch.Tensor | None = None, launch: Launch | None = None, block_n: int = 16,
              block_k: int = 128, num_warps: int = 4) -> torch.Tensor:
    """rms_norm(x + sum(parts), g, eps) @ w^T (+ bias) [m, n], or with swiglu (w = [gate; up] [2n, k])
    silu(gate) * up [m, n]. x [m, k] (rows contiguous); parts [s, m, k] fp32 or None; with parts,
    x + sum(parts) (rounded to x's dtype) is written to x_out [m, k] (not x)."""
    m, k = x.shape
    n = w.shape[0] // 2 if swiglu else w.shape[0]
    assert x.stride(1) == 1 and w.is_contiguous() and k == w.shape[1]
    nparts = 0 if parts is None else parts.shape[0]
    assert nparts == 0 or (x_out is not None and x_out is not x and parts.is_contiguous()), "parts need an x_out"
    launch = launch or Launch(x.device)
    y = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    pieces, piece_bytes = _pieces(k * w.element_size(), block_n, 32 * num_warps)
    _norm_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, parts if parts is not None else x, g, w, bias if bias is not None else w, y,
        x_out if x_out is not None else x, m, n, k, eps, x.stride(0), y.stride(0),
        NPART=nparts, HAS_BIAS=bias is not None, SWIGLU=swiglu, BLOCK_M=_block_m(m), BLOCK_N=block_n,
        BLOCK_K=block_k, PREFETCH=launch.prefetch and piece_bytes % 16 == 0, PIECES=pieces,
        PIECE_BYTES=piece_bytes, ESIZE=w.element_size(), PDL=launch.pdl, **launch.kwargs(num_warps))
    return y


def split_k(k: int, n: int, block_n: int = 16, block_k: int = 64, target: int = 132) -> int:
    """Splits of K for `gemv_parts`: the fewest (1, 2, 4 or 8) that give about `target` programs (an
    H100's SMs), each split a multiple of block_k."""
    s = 1
    while triton.cdiv(n, block_n) * s < target and k % (2 * s * block_k) == 0 and s < 8:
        s *= 2
    return s


def gemv_parts(a: torch.Tensor, w: torch.Tensor, splits: int, out: torch.Tensor | None = None,
               launch: Launch | None = None, block_n: int = 16, block_k: int = 64, num_warps: int = 4
               ) -> torch.Tensor:
    """The `splits` fp32 partial sums [splits, m, n] of a @ w^T over equal parts of K (a [m, k], rows
    contiguous; w [n, k])."""
    m, k = a.shape
    n = w.shape[0]
    assert a.stride(1) == 1 and w.is_contiguous() and k == w.shape[1] and k % splits == 0
    ksplit = k // splits
    assert ksplit % block_k == 0, (k, splits, block_k)
    launch = launch or Launch(a.device)
    p = out if out is not None else torch.empty(splits, m, n, dtype=torch.float32, device=a.device)
    pieces, piece_bytes = _pieces(ksplit * w.element_size(), block_n, 32 * num_warps)
    _gemv_part_kernel[(triton.cdiv(n, block_n), splits)](
        a, w, p, m, n, k, a.stride(0), ksplit, BLOCK_M=_block_m(m), BLOCK_N=block_n, BLOCK_K=block_k,
        PREFETCH=launch.prefetch and piece_bytes % 16 == 0, PIECES=pieces, PIECE_BYTES=piece_bytes,
        ESIZE=w.element_size(), PDL=launch.pdl, **launch.kwargs(num_warps))
    return p


def reference_norm_gemv(x, parts, g, eps, w, bias=None, swiglu=False):
    """The torch ops `norm_gemv` replaces: (x + sum(parts), rounded once; rms_norm; linear; SwiGLU)."""
    import torch.nn.functional as F

    if parts is not None:
        x = (x.float() + parts.sum(0)).to(x.dtype)
    y = F.linear(F.rms_norm(x, (x.shape[-1],), g, eps), w, bias)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y, x


def check() -> float:
    """Largest error of the gemv kernels against the torch ops (fp32, Triton's interpreter or a GPU),
    relative to each output's scale: norm + QKV with bias, norm + gate/up + SwiGLU over a residual with
    partial sums, and the split-K partial sums."""
    device = torch.device("cpu" if _interpreting() else "cuda")
    gen = torch.Generator().manual_seed(0)
    m, k, n = 5, 256, 48
    x = torch.randn(m, k, generator=gen).to(device)
    parts = (0.1 * torch.randn(2, m, k, generator=gen)).to(device)
    g = (1 + 0.1 * torch.randn(k, generator=gen)).to(device)
    w = (0.05 * torch.randn(2 * n, k, generator=gen)).to(device)
    b = torch.randn(n, generator=gen).to(device)
    worst = 0.0
    for swiglu, bias, pp in ((False, b, None), (True, None, parts), (False, b, parts)):
        ww = w if swiglu else w[:n].contiguous()
        x_out = torch.empty_like(x) if pp is not None else None
        y = norm_gemv(x, pp, g, EPS, ww, bias, swiglu, x_out=x_out, block_k=64)
        ref, x_ref = reference_norm_gemv(x, pp, g, EPS, ww, bias, swiglu)
        worst = max(worst, ((y - ref).abs().max() / ref.abs().max()).item())
        if pp is not None:
            worst = max(worst, ((x_out - x_ref).abs().max() / x_ref.abs().max()).item())
    a = torch.randn(m, k, generator=gen).to(device)
    pt = gemv_t(a, w, 2, torch.empty(2, m, 2 * n, device=device), block_n=64, block_k=64)
    worst = max(worst, ((pt.sum(0) - a @ w.t()).abs().max() / (a @ w.t()).abs().max()).item())
    p = gemv_parts(a, w, split_k(k, 2 * n, block_k=64), block_k=64)
    want = a @ w.t()
    return max(worst, ((p.sum(0) - want).abs().max() / want.abs().max()).item())


def build(shape: str, device: torch.device, rows: int, ctx: int, cache_len: int):
    h, ffn, layers, heads, groups, d, vocab = geometry(shape)
    gen = torch.Generator(device=device).manual_seed(0)

    def rnd(*s, scale=0.02):
        return torch.randn(*s, device=device, generator=gen, dtype=torch.bfloat16) * scale

    qkv_n = (heads + 2 * groups) * d
    ls = [dict(qkv=rnd(qkv_n, h), bias=rnd(qkv_n), o=rnd(h, heads * d), fc1=rnd(2 * ffn, h), fc2=rnd(h, ffn),
               g1=1 + rnd(h, scale=0.1), g2=1 + rnd(h, scale=0.1),
               keys=rnd(rows, groups, cache_len, d, scale=1.0), values=rnd(rows, groups, cache_len, d, scale=1.0))
          for _ in range(layers)]
    top = dict(g=1 + rnd(h, scale=0.1), lm=rnd(vocab, h))
    cos, sin = (t.to(device, torch.bfloat16) for t in random_rope_table(cache_len, d))
    pos = torch.full((rows,), ctx, device=device, dtype=torch.long)
    geo = dict(h=h, ffn=ffn, heads=heads, groups=groups, d=d, vocab=vocab, per=heads // groups)
    return ls, top, (cos, sin, pos), geo


def attention(x_qkv, layer, rope, geo, rows):
    per, d, g = geo["per"], geo["d"], geo["groups"]
    q = x_qkv.view(rows, g, per + 2, d)
    lengths = rope[2] + 1
    out = decode_attention(q, layer["keys"], layer["values"], lengths, layer["keys"].shape[2], d**-0.5, rope=rope)
    return out.reshape(rows, g * per * d)


def torch_step(x0, ls, top, rope, geo, use_attention):
    rows = x0.shape[0]
    x = x0.clone()
    for layer in ls:
        qkv = F.linear(F.rms_norm(x, (geo["h"],), layer["g1"], EPS), layer["qkv"], layer["bias"])
        a = attention(qkv, layer, rope, geo, rows) if use_attention else qkv[:, : geo["heads"] * geo["d"]]
        x.addmm_(a, layer["o"].t())
        up = F.linear(F.rms_norm(x, (geo["h"],), layer["g2"], EPS), layer["fc1"])
        x.addmm_(silu_mul(up), layer["fc2"].t())
    return F.linear(F.rms_norm(x, (geo["h"],), top["g"], EPS), top["lm"])


def prefetch_step(x0, ls, top, rope, geo, use_attention, schedule, side, limit):
    """torch_step with the weights asked into L2 ahead of their GEMMs, from a second stream: schedule
    "mlp+next": at layer i's start, layer i's gate/up and down and layer i+1's QKV and output projection;
    "next": at layer i's start, all of layer i+1."""
    rows = x0.shape[0]
    x = x0.clone()
    main = torch.cuda.current_stream()

    def ask(tensors):
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for t in tensors:
                prefetch_l2(t, limit=limit)

    if schedule == "next":
        ask([ls[0][k] for k in ("qkv", "o", "fc1", "fc2")])
    for i, layer in enumerate(ls):
        nxt = ls[i + 1] if i + 1 < len(ls) else None
        if schedule == "mlp+next":
            ask([layer["fc1"], layer["fc2"]] + ([nxt["qkv"], nxt["o"]] if nxt else []))
        elif nxt is not None:
            ask([nxt[k] for k in ("qkv", "o", "fc1", "fc2")])
        qkv = F.linear(F.rms_norm(x, (geo["h"],), layer["g1"], EPS), layer["qkv"], layer["bias"])
        a = attention(qkv, layer, rope, geo, rows) if use_attention else qkv[:, : geo["heads"] * geo["d"]]
        x.addmm_(a, layer["o"].t())
        up = F.linear(F.rms_norm(x, (geo["h"],), layer["g2"], EPS), layer["fc1"])
        x.addmm_(silu_mul(up), layer["fc2"].t())
    out = F.linear(F.rms_norm(x, (geo["h"],), top["g"], EPS), top["lm"])
    main.wait_stream(side)
    return out


def gemv_step(x0, ls, top, rope, geo, use_attention, launch, bufs, cfg):
    rows = x0.shape[0]
    cur, parts = x0, None
    a_cfg = dict(block_n=cfg["bn"], block_k=cfg["bk"], num_warps=cfg["warps"])
    p_cfg = dict(block_n=cfg["bn"], block_k=64, num_warps=cfg["warps"])

    def advance():
        return bufs["r0"] if cur is not bufs["r0"] else bufs["r1"]

    for layer in ls:
        nxt = advance() if parts is not None else None
        qkv = norm_gemv(cur, parts, layer["g1"], EPS, layer["qkv"], layer["bias"], x_out=nxt, out=bufs["qkv"],
                          launch=launch, **a_cfg)
        cur = nxt if nxt is not None else cur
        a = attention(qkv, layer, rope, geo, rows) if use_attention else qkv[:, : geo["heads"] * geo["d"]]
        parts = gemv_parts(a, layer["o"], bufs["so"], out=bufs["po"], launch=launch, **p_cfg)
        nxt = advance()
        act = norm_gemv(cur, parts, layer["g2"], EPS, layer["fc1"], swiglu=True, x_out=nxt, out=bufs["act"],
                          launch=launch, **a_cfg)
        cur = nxt
        parts = gemv_parts(act, layer["fc2"], bufs["sd"], out=bufs["pd"], launch=launch, **p_cfg)
    nxt = advance()
    return norm_gemv(cur, parts, top["g"], EPS, top["lm"], x_out=nxt, out=bufs["logits"], launch=launch, **a_cfg)


def timed(fn, reps: int) -> float:
    """ms per step: the step captured as one CUDA graph, replayed `reps` times."""
    return graph_ms(fn, reps)


def gemv_sweep(shape: str, rows_list: list[int], reps: int) -> None:
    """Each projection of the shape alone, one matrix per layer (no L2 reuse), 24-28 calls per graph: cuBLAS
    (F.linear) against the Triton GEMVs, us per call. Split-K rows leave the partial sums unreduced (in a
    fused layer the next kernel adds them)."""
    device = torch.device("cuda")
    h, ffn, layers, heads, groups, d, _ = geometry(shape)
    projections = {"qkv": ((heads + 2 * groups) * d, h), "o_proj": (h, heads * d), "gate/up": (2 * ffn, h),
                   "down": (h, ffn)}
    print(f"\nshape {shape}: us per call, {layers} matrices per graph")
    print("| rows | projection | MB | cuBLAS | TB/s | Triton, best of the weights-as-A configs | TB/s | config (block_n, block_k, splits, stages) | Triton, activations-as-A (gemv_parts), best |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m in rows_list:
        for name, (n, k) in projections.items():
            ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            mb = n * k * 2 / 1e6

            def per_call(fn):
                return timed(lambda: [fn(w) for w in ws], reps) * 1e3 / layers

            base = per_call(lambda w: F.linear(x, w))
            best, best_cfg = float("inf"), None
            for bn in (64, 128):
                for bk in (64, 128):
                    for splits in (1, 2, 4, 8):
                        if k % splits or (k // splits) % bk or triton.cdiv(n, bn) * splits > 4 * 132:
                            continue
                        for stages in (3, 5):
                            out = torch.empty(splits, m, n, device=device)
                            try:
                                t = per_call(lambda w: gemv_t(x, w, splits, out, bn, bk, 4, stages))
                            except Exception:
                                continue
                            if t < best:
                                best, best_cfg = t, (bn, bk, splits, stages)
            ref = F.linear(x, ws[0]).float()
            if best_cfg is not None:
                out = torch.empty(best_cfg[2], m, n, device=device)
                got = gemv_t(x, ws[0], best_cfg[2], out, best_cfg[0], best_cfg[1], 4, best_cfg[3]).sum(0)
                assert (got - ref).abs().max() <= 2e-2 * ref.abs().max(), name
            old = float("inf")
            for bn in (16, 32):
                s_ = split_k(k, n, block_n=bn)
                out = torch.empty(s_, m, n, device=device)
                try:
                    old = min(old, per_call(lambda w: gemv_parts(x, w, s_, out=out, launch=Launch(device, False, False),
                                                                 block_n=bn)))
                except Exception:
                    pass
            print(f"| {m} | {name} | {mb:.1f} | {base:.2f} | {mb / base:.2f} | {best:.2f} | "
                  f"{mb / best:.2f} | {best_cfg} | {old:.2f} |", flush=True)


def blas_sweep(shape: str, rows_list: list[int], reps: int, libraries: list[str]) -> None:
    """Each projection of the shape (and the LM head) alone, through the op the engine calls for it (F.linear,
    with QKV's bias; `addmm_` into the residual for o_proj and down), one matrix per layer (no L2 reuse),
    under each BLAS library torch can prefer (`torch.backends.cuda.preferred_blas_library`): us
    per call, TB/s of the weights and TFLOP/s."""
    device = torch.device("cuda")
    h, ffn, layers, heads, groups, d, vocab = geometry(shape)
    projections = {"qkv": ((heads + 2 * groups) * d, h), "o_proj": (h, heads * d), "gate/up": (2 * ffn, h),
                   "down": (h, ffn), "lm_head": (vocab, h)}
    print(f"\nshape {shape}: the engine's ops, us per call ({', '.join(libraries)})")
    print("| rows | projection | MB | " + " | ".join(f"{lib} us (TB/s, TFLOP/s)" for lib in libraries) + " |")
    print("|---|---|---|" + "---|" * len(libraries))
    for m in rows_list:
        for name, (n, k) in projections.items():
            count = 2 if name == "lm_head" else layers
            ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(count)]
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            bias = torch.randn(n, device=device, dtype=torch.bfloat16)
            y = torch.zeros(m, n, device=device, dtype=torch.bfloat16)
            mb = n * k * 2 / 1e6
            cells = []

            # the engine's op for each (trinity.rollout.slots.SlotDecoder._lean_layer): QKV with its bias,
            # the output and down projections added into the residual stream in place (addmm_)
            def op(w):
                if name == "qkv":
                    return F.linear(x, w, bias)
                if name in ("o_proj", "down"):
                    return y.addmm_(x, w.t())
                return F.linear(x, w)

            for lib in libraries:
                torch.backends.cuda.preferred_blas_library(lib)
                t = timed(lambda: [op(w) for w in ws], reps) * 1e3 / count
                cells.append(f"{t:.2f} ({mb / t:.2f}, {2 * m * n * k / t / 1e6:.0f})")
            torch.backends.cuda.preferred_blas_library("default")
            print(f"| {m} | {name} | {mb:.1f} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="0.5b")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--ctx", type=int, default=300, help="keys per row the attention reads")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--no-attention", action="store_true", help="leave the attention out of both paths")
    ap.add_argument("--configs", default="16,128,4;16,128,8;32,128,4;16,64,4",
                    help="block_n,block_k,num_warps of the gemv kernels; ';'-separated")
    ap.add_argument("--prefetch", nargs="*", default=["mlp+next", "next"], help="L2-prefetch schedules for the torch ops")
    ap.add_argument("--no-gemv", action="store_true")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="each projection alone: cuBLAS against the Triton GEMVs")
    ap.add_argument("--blas", nargs="+", default=["default"],
                    help="BLAS libraries to prefer for the torch ops (default, cublas, cublaslt); with --sweep-blas: "
                         "those to compare")
    ap.add_argument("--sweep-blas", action="store_true", help="each projection and the LM head alone, per BLAS library")
    args = ap.parse_args()
    err = check()
    print(f"gemv kernels vs torch ops, fp32: max relative error {err:.2e}")
    # on a GPU tl.dot multiplies fp32 in TF32 (10-bit mantissa); the interpreter in full fp32
    assert err < (1e-5 if _interpreting() else 5e-3), err
    if args.check_only or _interpreting():
        return
    if args.sweep:
        gemv_sweep(args.shape, args.rows, args.reps)
        return
    if args.sweep_blas:
        blas_sweep(args.shape, args.rows, args.reps, args.blas)
        return
    device = torch.device("cuda")
    use_attention = not args.no_attention
    cfgs = [dict(zip(("bn", "bk", "warps"), map(int, c.split(",")))) for c in args.configs.split(";")]
    props = torch.cuda.get_device_properties(device)
    print(f"{props.name}, {props.multi_processor_count} SMs; shape {args.shape}; attention "
          f"{'on (ctx %d)' % args.ctx if use_attention else 'off'}")
    print("| rows | path | prefetch | PDL | config | ms per step | vs torch ops | logits max diff / max |")
    print("|---|---|---|---|---|---|---|---|")
    for rows in args.rows:
        cache_len = -(-(args.ctx + 1) // 256) * 256
        ls, top, rope, geo = build(args.shape, device, rows, args.ctx, cache_len)
        weight_bytes = sum(t.numel() * 2 for layer in ls for k, t in layer.items() if k not in ("keys", "values"))
        weight_bytes += top["lm"].numel() * 2
        x0 = torch.randn(rows, geo["h"], device=device, dtype=torch.bfloat16)
        for lib in args.blas:
            torch.backends.cuda.preferred_blas_library(lib)
            t = timed(lambda: torch_step(x0, ls, top, rope, geo, use_attention), args.reps)
            if lib == args.blas[0]:
                base = t
            print(f"| {rows} | torch ops ({lib} BLAS) | - | - | - | {t:.3f} | {t / base:.2f} | "
                  f"(weights {weight_bytes / 1e9:.2f} GB) |", flush=True)
        torch.backends.cuda.preferred_blas_library(args.blas[0])
        ref = torch_step(x0, ls, top, rope, geo, use_attention).float()
        side = torch.cuda.Stream()
        for schedule in args.prefetch:
            for limit in (None, 24 << 20):
                t = timed(lambda: prefetch_step(x0, ls, top, rope, geo, use_attention, schedule, side, limit), args.reps)
                got = prefetch_step(x0, ls, top, rope, geo, use_attention, schedule, side, limit).float()
                same = torch.equal(got, ref)
                print(f"| {rows} | torch ops + L2 prefetch ({schedule}, limit {limit}) | - | - | - | {t:.3f} | {t / base:.2f} | "
                      f"{'equal' if same else 'DIFFERENT'} |", flush=True)
        if args.no_gemv:
            continue
        so = split_k(geo["heads"] * geo["d"], geo["h"])
        sd = split_k(geo["ffn"], geo["h"])
        bufs = dict(r0=torch.empty_like(x0), r1=torch.empty_like(x0), so=so, sd=sd,
                    po=torch.empty(so, rows, geo["h"], device=device), pd=torch.empty(sd, rows, geo["h"], device=device),
                    qkv=torch.empty(rows, ls[0]["qkv"].shape[0], device=device, dtype=torch.bfloat16),
                    act=torch.empty(rows, geo["ffn"], device=device, dtype=torch.bfloat16),
                    logits=torch.empty(rows, geo["vocab"], device=device, dtype=torch.bfloat16))
        variants = [(c, True, True) for c in cfgs] + [(cfgs[0], False, False), (cfgs[0], True, False), (cfgs[0], False, True)]
        for cfg, prefetch, pdl in variants:
            launch = Launch(device, prefetch=prefetch, pdl=pdl)
            try:
                got = gemv_step(x0, ls, top, rope, geo, use_attention, launch, bufs, cfg).float()
                t = timed(lambda: gemv_step(x0, ls, top, rope, geo, use_attention, launch, bufs, cfg), args.reps)
            except Exception as exc:  # a config Triton cannot build or a capture the driver refuses
                print(f"| {rows} | gemv | {prefetch} | {pdl} | {cfg} | failed: {type(exc).__name__}: {str(exc)[:200]} | | |")
                continue
            diff = (got - ref).abs().max().item() / ref.abs().max().item()
            print(f"| {rows} | gemv | {launch.prefetch} | {launch.pdl} | {cfg['bn']},{cfg['bk']},{cfg['warps']} | "
                  f"{t:.3f} | {t / base:.2f} | {diff:.2e} |", flush=True)
        print(f"| {rows} | (floor: weights once at 3.0 TB/s) | | | | {weight_bytes / 3.0e9:.3f} | | |")


if __name__ == "__main__":
    main()
