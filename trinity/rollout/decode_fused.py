"""Fused pointwise kernels of a decode step (Triton, CUDA only): RoPE + KV-cache store, and SwiGLU.

Why: a 7B decode step spends ~15% of its GPU time in small pointwise kernels between the GEMMs
(profile of the 512-row lognormal rollout, docs/performance.md): per layer, RoPE is ~6 kernels
(two products, the rotate-half negation and concatenation, a sum, the q/k split), the cache write two
index_put kernels, SwiGLU two kernels that write and re-read the [rows, ffn] activation. Each costs a
few microseconds even inside a CUDA graph, and the tail of a rollout runs ~1000 steps of 28 layers.

- `rope_store(qkv, cos, sin, pos, keys, values)`: for each row b and query group j of the QKV
  projection [b, groups, per + 2, d] (a group's `per` query heads, then its key and value head, the
  layout of megatron's fused linear_qkv), rotate the query heads and the key head by RoPE at the row's
  position pos[b], write the key and the value into the cache at [b, j, pos[b]], and return the rotated
  queries [b, groups, per, d]. The arithmetic is megatron's `_apply_rotary_pos_emb_bshd` in the same
  order, each product and the sum rounded to the tensors' dtype as the eager ops round them (no fused
  multiply-add), so that it equals the torch path (`trinity.rollout.decode._rope`) up to the last bit
  (the first-use check allows rounding-level differences).
- `silu_mul(up)`: SwiGLU's silu(gate) * value of up = [gate | value] [m, 2f] -> [m, f], silu rounded to
  the dtype before the product as `F.silu(gate) * value` rounds it.

Both are checked against the torch ops at their first use in a process (`available`); the decoder uses
the torch ops where they are not available (CPU, no Triton, a failed check) or not wanted
(`DecodeKernels.fused`).
"""

from __future__ import annotations


import torch

from trinity.rollout.first_use import checked_once, triton_runs, verdict
from trinity.rollout.rope_triton import random_rope_table, reference_rope_store

try:  # triton ships with CUDA builds of torch; CPU runs use the torch ops
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None


def available(device: torch.device, head_dim: int, per: int, rot: int, dtype: torch.dtype) -> bool:
    """Whether the fused kernels run here: Triton on CUDA (or Triton's interpreter), RoPE over the whole
    head (rot == head_dim, a power of two of 16..256), and a first run that equals the torch ops."""
    if not triton_runs(device):
        return False
    if rot != head_dim or head_dim not in (16, 32, 64, 128, 256):
        return False
    return checked_once(_CHECKED, (str(device), head_dim, per, dtype), lambda: _self_check(device, head_dim, per, dtype))


_CHECKED: dict[tuple, bool] = {}


def _self_check(device: torch.device, head_dim: int, per: int, dtype: torch.dtype) -> bool:
    import torch.nn.functional as F

    def check() -> str | None:
        g = torch.Generator(device="cpu").manual_seed(0)
        b, groups, cache = 5, 2, 96
        qkv = torch.randn(b, groups, per + 2, head_dim, generator=g).to(device, dtype)
        cos, sin = (t.to(device, dtype) for t in random_rope_table(cache, head_dim, g))
        pos = torch.tensor([0, 5, 17, 95, 40], device=device)
        caches = [torch.randn(b + 1, groups, cache, head_dim, generator=g).to(device, dtype) for _ in range(2)]
        mine = [c.clone() for c in caches]
        ref_q = reference_rope_store(qkv, cos, sin, pos, *caches)
        q = rope_store(qkv, cos, sin, pos, *mine)
        up = torch.randn(7, 2 * 320, generator=g).to(device, dtype)
        gate, value = torch.chunk(up, 2, dim=-1)
        pairs = {"rope q": (q, ref_q), "key cache": (mine[0], caches[0]), "value cache": (mine[1], caches[1]),
                 "swiglu": (silu_mul(up), F.silu(gate) * value)}
        errors = {name: ((a.float() - b.float()).norm() / b.float().norm()).item() for name, (a, b) in pairs.items()}
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        if max(errors.values()) <= tol:
            return None
        return "relative error against the torch ops: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items())

    return verdict(check, "fused decode kernels disabled ({reason}); the decoder uses the torch ops")


if triton is not None:

    # the RoPE arithmetic and the rounding helper of the split-KV kernel (one definition)
    from trinity.rollout.rope_triton import _round, _rope_at, _rope_row

    @triton.jit
    def _rope_store_kernel(QKV, COS, SIN, POS, KC, VC, QO,
                           s_x_b, s_x_g, s_c, s_k_b, s_k_g, s_k_n, s_v_b, s_v_g, s_v_n, s_q_b, s_q_g, s_q_h,
                           PER: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr):
        b = tl.program_id(0)
        j = tl.program_id(1)
        heads = tl.arange(0, H_PAD)
        dims = tl.arange(0, D)
        p, partner, sign, c, sn = _rope_row(COS, SIN, POS, b, s_c, dims, D)
        base = QKV + b * s_x_b + j * s_x_g
        # the query heads and the key head (row PER) are rotated; the value is copied
        o = _rope_at(base, heads[:, None] * D + dims[None, :], heads[:, None] * D + partner[None, :], sign[None, :],
                     c[None, :], sn[None, :], heads[:, None] < PER + 1, QKV.dtype.element_ty)
        tl.store(QO + b * s_q_b + j * s_q_g + heads[:, None] * s_q_h + dims[None, :], o, mask=heads[:, None] < PER)
        tl.store(KC + b * s_k_b + j * s_k_g + p * s_k_n + heads[:, None] * 0 + dims[None, :], o,
                 mask=heads[:, None] == PER)
        v = tl.load(base + (PER + 1) * D + dims)
        tl.store(VC + b * s_v_b + j * s_v_g + p * s_v_n + dims, v)

    @triton.jit
    def _silu_mul_kernel(UP, OUT, f, s_u, s_o, BLOCK: tl.constexpr):
        m = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < f
        DT = UP.dtype.element_ty
        gate = tl.load(UP + m * s_u + cols, mask=mask, other=0.0).to(tl.float32)
        value = tl.load(UP + m * s_u + f + cols, mask=mask, other=0.0).to(tl.float32)
        act = _round(gate / (1.0 + tl.exp(-gate)), DT)
        tl.store(OUT + m * s_o + cols, (act * value).to(DT), mask=mask)


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
               keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """qkv [b, groups, per + 2, d] (contiguous heads); cos/sin [cache_len, d] (the RoPE table by
    position); pos [b]; keys/values [slots >= b, groups, cache_len, d]. Writes row b's key and value at
    position pos[b] of slot b; returns the rotated queries [b, groups, per, d] (module doc)."""
    b, g, heads, d = qkv.shape
    per = heads - 2
    assert qkv.stride(3) == 1 and qkv.stride(2) == d and cos.stride(1) == 1 and sin.stride() == cos.stride()
    q = torch.empty(b, g, per, d, dtype=qkv.dtype, device=qkv.device)
    _rope_store_kernel[(b, g)](
        qkv, cos, sin, pos, keys, values, q,
        qkv.stride(0), qkv.stride(1), cos.stride(0), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), q.stride(0), q.stride(1), q.stride(2),
        PER=per, H_PAD=triton.next_power_of_2(per + 1), D=d,
        enable_fp_fusion=False,  # no fused multiply-add: the eager ops round each product before the sum
    )
    return q


def silu_mul(up: torch.Tensor) -> torch.Tensor:
    """up [m, 2f] = [gate | value] -> silu(gate) * value [m, f]."""
    m, two_f = up.shape
    f = two_f // 2
    assert up.stride(1) == 1
    out = torch.empty(m, f, dtype=up.dtype, device=up.device)
    block = 1024
    _silu_mul_kernel[(m, triton.cdiv(f, block))](up, out, f, up.stride(0), out.stride(0), BLOCK=block)
    return out
