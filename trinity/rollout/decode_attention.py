"""Split-KV decode attention over per-row context lengths (a Triton kernel, CUDA only).

Why: a decode step of the continuous-batching engine has rows of very different context lengths. SDPA
over a [rows, groups, L, d] cache slice with a mask reads all L keys of every row (the mask does not
skip memory); this kernel reads each row's live keys only (`lengths[b]` of them), which is what the
live-KV floor of a rollout counts.

Layout: queries [b, groups, per, d] (a group's query heads stacked, as the lean decode path computes
them), the cache [slots, groups, cache_len, d]; row b attends to keys 0..lengths[b]-1 of slot b. The
grid is (row, group, split): each program runs an online softmax over its split of the keys (stopping
at the row's end) and writes its partial sum, maximum and normaliser; `_combine_kernel` merges the splits in
fp32. With enough rows there is one split per row and the program writes the normalised output. Every shape is fixed for a given (rows, L) bucket, so the launch is captured
in the decode step's CUDA graph.
"""

from __future__ import annotations

import os

import torch

from trinity.rollout.first_use import checked_once, triton_runs, verdict
from trinity.rollout.kernels import FULL_GRID

try:  # triton ships with CUDA builds of torch; CPU runs use SDPA and never import the kernel
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None

SPLIT = 256  # keys per program
BLOCK_N = 64  # keys per inner iteration


def available(device: torch.device, head_dim: int, per: int, dtype: torch.dtype) -> bool:
    """Whether the kernel runs here: Triton on CUDA, a head size of 16..256 in powers of two, at most 16
    query heads per group (the padded query tile), and its first run (once per process and shape)
    agreed with SDPA; otherwise the engine uses SDPA and a warning says why (`DecodeKernels.split_kv`
    turns it off for a comparison)."""
    if not triton_runs(device):
        return False
    if head_dim not in (16, 32, 64, 128, 256) or per > 16:
        return False
    return checked_once(_CHECKED, (str(device), head_dim, per, dtype), lambda: _self_check(device, head_dim, per, dtype))


_CHECKED: dict[tuple, bool] = {}


def _self_check(device: torch.device, head_dim: int, per: int, dtype: torch.dtype) -> bool:
    """The kernel against SDPA on random rows of 1..700 keys; False (and a warning) on any error or a
    difference above the dtype's rounding."""
    import torch.nn.functional as F

    def check() -> str | None:
        g = torch.Generator(device="cpu").manual_seed(0)
        b, groups, cache = 5, 2, 768
        q = torch.randn(b, groups, per, head_dim, generator=g).to(device, dtype)
        k = torch.randn(b + 1, groups, cache, head_dim, generator=g).to(device, dtype)
        v = torch.randn(b + 1, groups, cache, head_dim, generator=g).to(device, dtype)
        lengths = torch.tensor([1, 64, 300, 513, 700], device=device)
        outs = [decode_attention(q, k, v, lengths, cache, head_dim**-0.5, splits=n).float() for n in (None, 1)]

        def sdpa(q: torch.Tensor) -> torch.Tensor:
            return torch.cat([F.scaled_dot_product_attention(q[i:i + 1].float(), k[i:i + 1, :, :n].float(),
                                                             v[i:i + 1, :, :n].float(), scale=head_dim**-0.5)
                              for i, n in enumerate(lengths.tolist())])

        ref = sdpa(q)
        err = max(((out - ref).norm() / ref.norm()).item() for out in outs)
        # shared prompts: rows 1.. read their first 48 keys from slot 0 (their own copies are garbage here),
        # against SDPA over caches where those keys are slot 0's
        plen = torch.full((b,), 48, device=device)
        src = torch.zeros(b, dtype=torch.long, device=device)
        for n in (None, 1):
            out = decode_attention(q, k, v, lengths, cache, head_dim**-0.5, splits=n, prefix=(src, plen)).float()
            shared_k, shared_v = k.clone(), v.clone()
            shared_k[:, :, :48], shared_v[:, :, :48] = k[:1, :, :48], v[:1, :, :48]
            want = torch.cat([F.scaled_dot_product_attention(q[i:i + 1].float(), shared_k[i:i + 1, :, :m].float(),
                                                              shared_v[i:i + 1, :, :m].float(), scale=head_dim**-0.5)
                              for i, m in enumerate(lengths.tolist())])
            err = max(err, ((out - want).norm() / want.norm()).item())
        # with RoPE and the cache store in the kernel, against the torch ops, then SDPA
        from trinity.rollout.rope_triton import random_rope_table, reference_rope_store

        qkv = torch.randn(b, groups, per + 2, head_dim, generator=g).to(device, dtype)
        cos, sin = (t.to(device, dtype) for t in random_rope_table(cache, head_dim, g))
        mine = (k.clone(), v.clone())
        ref_q = reference_rope_store(qkv, cos, sin, lengths - 1, k, v)
        for n in (None, 1):
            out = decode_attention(qkv, *mine, lengths, cache, head_dim**-0.5, splits=n, rope=(cos, sin, lengths - 1))
            err = max(err, ((out.float() - sdpa(ref_q)).norm() / sdpa(ref_q).norm()).item())
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        if err > tol:
            return f"relative error {err:.2e} against SDPA"
        same = torch.equal(mine[0], k) and torch.equal(mine[1], v)
        return None if same else "the cache written with RoPE in the kernel differs from the torch ops'"

    return verdict(check, "split-KV decode attention disabled ({reason}); the rollout uses SDPA")




if triton is not None:

    # the RoPE arithmetic and the rounding helper, shared with trinity.rollout.decode_fused's kernel
    from trinity.rollout.rope_triton import _rope_at, _rope_row

    @triton.jit
    def _block(q, K, V, b, src, plen, g, sk_b, sk_g, sk_n, sv_b, sv_g, sv_n, cols, end, dims, m_i, l_i, acc, scale,
               PRECISION: tl.constexpr):
        """One block of keys `cols` (those >= end masked) folded into the online softmax (m_i, l_i, acc).
        Keys before `plen` come from slot `src` (the shared prompt), the others from the row's own slot b."""
        live = cols < end
        slot = tl.where(cols < plen, src, b).to(tl.int64)
        k = tl.load(K + slot[:, None] * sk_b + g * sk_g + cols[:, None] * sk_n + dims[None, :], mask=live[:, None], other=0.0)
        v = tl.load(V + slot[:, None] * sv_b + g * sv_g + cols[:, None] * sv_n + dims[None, :], mask=live[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
        scores = tl.where(live[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all masked so far: no NaN from -inf - -inf
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
        return m_new, l_i, acc

    @triton.jit
    def _split_kernel(Q, K, V, Lens, Src, Plen, Acc, Mx, Den, COS, SIN, POS, scale,
                      sq_b, sq_g, sq_p, sk_b, sk_g, sk_n, sv_b, sv_g, sv_n,
                      sa_b, sa_g, sa_s, sa_p, sm_b, sm_g, sm_s, s_c,
                      PER: tl.constexpr, P_PAD: tl.constexpr, D: tl.constexpr,
                      SPLIT_LEN: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr,
                      SINGLE: tl.constexpr, DYNAMIC: tl.constexpr, ROPE: tl.constexpr, SHARE: tl.constexpr):
        b = tl.program_id(0)
        g = tl.program_id(1)
        s = tl.program_id(2)
        n_keys = tl.load(Lens + b)
        if SHARE:  # the row's first plen keys (its prompt) are read from slot src, as the other rows of its prompt read them
            src = tl.load(Src + b)
            plen = tl.load(Plen + b)
        else:
            src = b
            plen = 0
        start = s * SPLIT_LEN
        end = tl.minimum(start + SPLIT_LEN, n_keys)
        rows = tl.arange(0, P_PAD)
        dims = tl.arange(0, D)
        if ROPE:
            # Q is the QKV projection [b, groups, PER + 2, D]: every program of the row rotates the query
            # heads itself; the one whose split holds the row's position p first writes the rotated key and
            # the value there, then reads them back with the rest of its split (the block-wide barrier
            # orders its threads' global writes before their reads; no other program reads position p)
            DT = Q.dtype.element_ty
            p, partner, sign, c, sn = _rope_row(COS, SIN, POS, b, s_c, dims, D)
            base = Q + b * sq_b + g * sq_g
            q = _rope_at(base, rows[:, None] * sq_p + dims[None, :], rows[:, None] * sq_p + partner[None, :],
                         sign[None, :], c[None, :], sn[None, :], rows[:, None] < PER, DT)
            if s == p // SPLIT_LEN:
                k = _rope_at(base, PER * sq_p + dims, PER * sq_p + partner, sign, c, sn, dims < D, DT)
                tl.store(K + b * sk_b + g * sk_g + p * sk_n + dims, k)
                tl.store(V + b * sv_b + g * sv_g + p * sv_n + dims, tl.load(base + (PER + 1) * sq_p + dims))
            tl.debug_barrier()
        else:
            q = tl.load(Q + b * sq_b + g * sq_g + rows[:, None] * sq_p + dims[None, :], mask=rows[:, None] < PER, other=0.0)
        m_i = tl.full([P_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([P_PAD], tl.float32)
        acc = tl.zeros([P_PAD, D], tl.float32)
        if DYNAMIC:  # compiled: stop at the row's end
            for n0 in range(start, end, BLOCK):
                m_i, l_i, acc = _block(q, K, V, b, src, plen, g, sk_b, sk_g, sk_n, sv_b, sv_g, sv_n, n0 + tl.arange(0, BLOCK), end,
                                       dims, m_i, l_i, acc, scale, PRECISION)
        else:  # Triton's interpreter (CPU tests) takes no tensor loop bounds: a fixed trip count, masked
            for i in range(SPLIT_LEN // BLOCK):
                if start + i * BLOCK < end:  # blocks past the row's end skipped
                    m_i, l_i, acc = _block(q, K, V, b, src, plen, g, sk_b, sk_g, sk_n, sv_b, sv_g, sv_n,
                                           start + i * BLOCK + tl.arange(0, BLOCK), end, dims, m_i, l_i, acc, scale,
                                           PRECISION)
        if SINGLE:  # one split holds the whole row: the normalised output, in the output's dtype
            out = acc / l_i[:, None]
            tl.store(Acc + b * sa_b + g * sa_g + rows[:, None] * sa_p + dims[None, :], out.to(Acc.dtype.element_ty),
                     mask=rows[:, None] < PER)
        else:
            base = b * sm_b + g * sm_g + s * sm_s
            tl.store(Mx + base + rows, m_i)
            tl.store(Den + base + rows, l_i)
            tl.store(Acc + b * sa_b + g * sa_g + s * sa_s + rows[:, None] * sa_p + dims[None, :], acc)


    @triton.jit
    def _combine_kernel(Acc, Mx, Den, Out, sa_b, sa_g, sa_s, sa_p, sm_b, sm_g, sm_s, so_b, so_g, so_p,
                        PER: tl.constexpr, P_PAD: tl.constexpr, D: tl.constexpr, S: tl.constexpr,
                        S_PAD: tl.constexpr):
        """Merge the splits' online-softmax partials, one program per (row, group): each split's sum
        weighed by exp(its max - the top max), divided by the weighed normalisers. A split past the row's
        end has max -inf and weighs 0 (split 0 always holds a key)."""
        b = tl.program_id(0)
        g = tl.program_id(1)
        rows = tl.arange(0, P_PAD)
        dims = tl.arange(0, D)
        sp = tl.arange(0, S_PAD)
        stat = b * sm_b + g * sm_g + sp[:, None] * sm_s + rows[None, :]
        mx = tl.load(Mx + stat, mask=sp[:, None] < S, other=float("-inf"))  # [S_PAD, P_PAD]
        top = tl.max(mx, 0)  # split 0 always holds a key: finite
        w = tl.exp(mx - top[None, :])  # a split with no key (-inf) weighs 0
        den = tl.sum(tl.load(Den + stat, mask=sp[:, None] < S, other=0.0) * w, 0)
        num = tl.zeros([P_PAD, D], tl.float32)
        for s in range(S):
            ws = tl.exp(tl.load(Mx + b * sm_b + g * sm_g + s * sm_s + rows) - top)
            part = tl.load(Acc + b * sa_b + g * sa_g + s * sa_s + rows[:, None] * sa_p + dims[None, :])
            num += part * ws[:, None]
        out = num / den[:, None]
        tl.store(Out + b * so_b + g * so_g + rows[:, None] * so_p + dims[None, :], out.to(Out.dtype.element_ty),
                 mask=rows[:, None] < PER)


def full_grid(tune: dict | None = None) -> int:
    """Rows x groups from which each (row, group) is one program: `tune`'s (a benchmark's, or the engine's
    `DecodeKernels.full_grid`), else FULL_GRID."""
    return (tune or {}).get("full_grid") or FULL_GRID


def num_splits(programs: int, L: int, tune: dict | None = None) -> int:
    """Splits per row for `programs` (rows x groups) over L keys: one where the rows alone fill the GPU
    (`full_grid`), else L / SPLIT."""
    return 1 if programs >= full_grid(tune) else -(-L // (tune or {}).get("split", SPLIT))


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                     L: int, scale: float, splits: int | None = None, tune: dict | None = None, *,
                     rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                     prefix: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q [b, groups, per, d]; keys/values [slots >= b, groups, cache_len, d]; lengths [b] (keys per
    row, >= 1); L >= max(lengths). Returns [b, groups, per, d] in q's dtype.

    With b x groups >= `full_grid(tune)` programs (or splits=1) each program takes a whole row and writes the
    normalised output; fewer rows (a rollout's tail) split each row into L / SPLIT parts that `_combine_kernel`
    merges, so that the GPU still has enough programs. `tune` (benchmarks/decode_kernels.py) overrides
    block_n, split, full_grid, num_warps and num_stages.

    rope=(cos, sin, pos): q is the QKV projection [b, groups, per + 2, d] (contiguous heads: a group's
    query heads, its key, its value), and the kernel first does what `trinity.rollout.decode_fused.rope_store`
    does, with the same roundings: RoPE on the query heads and the key at position pos[b] < L (cos/sin
    [cache_len, d]), key and value written into row b's cache at pos[b]. One kernel fewer per layer
    (benchmarks/decode_kernels.py --what layers).

    prefix=(src, plen), [b] each: row b reads its keys and values 0..plen[b]-1 from slot src[b] (which
    must hold the same ones: the n samples of a prompt each keep a copy of its prompt's, and all read one
    of them), the rest from slot b. Rows of a prompt sit in neighbouring programs, so the prompt's keys
    come from DRAM about once per step and from L2 for the other samples (benchmarks/decode_kernels.py
    --what prefix)."""
    tune = tune or {}
    block_n = tune.get("block_n", BLOCK_N)
    b, g, per, d = q.shape
    if rope is not None:
        per -= 2
        cos, sin, pos = rope
        assert q.stride(3) == 1 and q.stride(2) == d and cos.stride(1) == 1 and sin.stride() == cos.stride()
    else:
        cos = sin = pos = q  # not read
    src, plen = prefix if prefix is not None else (lengths, lengths)  # not read without prefix
    if splits is None:
        splits = num_splits(b * g, L, tune)
    split_len = -(-(-(-L // splits)) // block_n) * block_n
    p_pad = 16
    launch = {k: tune[k] for k in ("num_warps", "num_stages") if k in tune}
    common = dict(PER=per, P_PAD=p_pad, D=d, SPLIT_LEN=split_len, BLOCK=block_n, **launch,
                  # fp32 caches (tests, CPU-precision checks) multiply in full fp32, not TF32
                  PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                  SINGLE=splits == 1, DYNAMIC=os.environ.get("TRITON_INTERPRET") != "1", ROPE=rope is not None,
                  SHARE=prefix is not None,
                  # no fused multiply-add where RoPE rounds each product as the eager ops do (a bf16 run
                  # with them failed the first-use check's exact cache comparison on an H100)
                  enable_fp_fusion=rope is None)
    strides = (q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
               values.stride(0), values.stride(1), values.stride(2))
    if splits == 1:
        out = torch.empty(b, g, per, d, dtype=q.dtype, device=q.device)
        _split_kernel[(b, g, 1)](q, keys, values, lengths, src, plen, out, out, out, cos, sin, pos, scale, *strides,
                                 out.stride(0), out.stride(1), 0, out.stride(2), 0, 0, 0, cos.stride(0), **common)
        return out
    acc = torch.empty(b, g, splits, p_pad, d, dtype=torch.float32, device=q.device)
    mx = torch.empty(b, g, splits, p_pad, dtype=torch.float32, device=q.device)
    den = torch.empty_like(mx)
    _split_kernel[(b, g, splits)](
        q, keys, values, lengths, src, plen, acc, mx, den, cos, sin, pos, scale, *strides,
        acc.stride(0), acc.stride(1), acc.stride(2), acc.stride(3), mx.stride(0), mx.stride(1), mx.stride(2),
        cos.stride(0), **common,
    )
    # one merge kernel instead of ~9 torch ops (max, exp, products, sums, division): the rollout's
    # tail runs these steps ~700 times x layers
    out = torch.empty(b, g, per, d, dtype=q.dtype, device=q.device)
    _combine_kernel[(b, g)](acc, mx, den, out, acc.stride(0), acc.stride(1), acc.stride(2), acc.stride(3),
                            mx.stride(0), mx.stride(1), mx.stride(2), out.stride(0), out.stride(1), out.stride(2),
                            PER=per, P_PAD=p_pad, D=d, S=splits, S_PAD=triton.next_power_of_2(splits))
    return out
