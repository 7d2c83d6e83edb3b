"""RoPE in the decode kernels: the Triton helpers both kernels rotate with (`_rope_row`, `_rope_at`, `_round`:
one definition of the arithmetic and its roundings) and the torch ops they are checked against
(`reference_rope_store`, on `random_rope_table`s).

The arithmetic is megatron's `_apply_rotary_pos_emb_bshd` in the same order, each product and the sum
rounded to the tensors' dtype as the eager ops round them; the kernels that call these helpers compile
without fused multiply-adds, which would skip a rounding.
"""

from __future__ import annotations

import torch

try:  # triton ships with CUDA builds of torch; CPU runs use the torch ops
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None


def reference_rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                         keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The torch ops `rope_store` replaces (what the lean decode layer computes without it)."""
    from trinity.rollout.decode import _rope

    b, g, heads, d = qkv.shape
    per = heads - 2
    c, s = cos.index_select(0, pos).view(b, 1, 1, d), sin.index_select(0, pos).view(b, 1, 1, d)
    qk = _rope(qkv[:, :, : per + 1], c, s)
    rows = torch.arange(b, device=qkv.device)
    keys[rows, :, pos] = qk[:, :, per]
    values[rows, :, pos] = qkv[:, :, per + 1]
    return qk[:, :, :per].contiguous()


def random_rope_table(cache_len: int, head_dim: int, generator: torch.Generator | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [cache_len, head_dim] (fp32, CPU) of random frequencies, in the layout of megatron's RoPE
    table (both halves of a row the same angles): the input of the kernels' checks, tests and benchmarks."""
    angles = torch.rand(cache_len, head_dim // 2, generator=generator) * torch.arange(cache_len).view(cache_len, 1)
    angles = torch.cat([angles, angles], dim=-1)
    return torch.cos(angles), torch.sin(angles)


if triton is not None:

    @triton.jit
    def _round(x, DT: tl.constexpr):
        """x rounded to the tensors' dtype (as an eager op's result is), kept in fp32 for what follows."""
        return x.to(DT).to(tl.float32)

    @triton.jit
    def _rope_row(COS, SIN, POS, b, s_c, dims, D: tl.constexpr):
        """Row b's position p and what RoPE needs there, per head element d: its partner in
        rotate_half(x) = [-x2 | x1] (d + D/2 mod D), that partner's sign, and cos/sin of the table's row p."""
        p = tl.load(POS + b)
        partner = (dims + D // 2) % D
        sign = tl.where(dims < D // 2, -1.0, 1.0)
        c = tl.load(COS + p * s_c + dims).to(tl.float32)
        sn = tl.load(SIN + p * s_c + dims).to(tl.float32)
        return p, partner, sign, c, sn

    @triton.jit
    def _rope_at(ptr, offs, partner, sign, c, s, mask, DT: tl.constexpr):
        """RoPE of the head elements at ptr + offs (`partner` offsets and `sign` from `_rope_row`):
        x * cos + rotate_half(x) * sin, each product and the sum rounded to the dtype as megatron's eager
        ops round them. The one definition of the decode kernels' RoPE (trinity.rollout.decode_attention's
        and trinity.rollout.decode_fused's); their callers compile without fused multiply-adds, which would
        skip a rounding."""
        x = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
        xr = tl.load(ptr + partner, mask=mask, other=0.0).to(tl.float32) * sign
        return _round(_round(x * c, DT) + _round(xr * s, DT), DT).to(DT)
