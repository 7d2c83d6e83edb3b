"""Fused rotary position embedding for our layer spec (used where TransformerEngine does not import).

megatron-core applies RoPE unfused unless `apply_rope_fusion` is on, and its fused path calls
TransformerEngine's kernel through `rope_utils.fused_apply_rotary_pos_emb`, which is None without TE.
Unfused, each of q and k goes through cos/sin, a chunk + neg + cat, two muls, an add and a final cat,
in forward and again in backward: about ten passes over q per layer (profiled at ~5 ms of a 110 ms
0.5B step on an H200, benchmarks/NOTES.md). `fused_rope` has TE's signature and does one read and one
write of the tensor in each direction: forward and backward are single compiled pointwise kernels
(fp32 math inside, as TE's), with the gradient written as the transposed rotation, so nothing but the
cos/sin tables is kept for backward.

cos/sin of the table: computed inside the kernel for every element of q and k, they made the RoPE
kernels compute-bound (a 7B layer's forward RoPE took ~110 us on an H200, where moving q and k takes
~15 us). Eager layers take them from `_cos_sin`, computed once per rotary table: megatron's
`RotaryEmbedding` returns the same (lru-cached) table tensor to every layer of a forward and to later
forwards of that length (0.5B SFT job on an H200: 0.0994 -> 0.0941 s/step, benchmarks/NOTES.md).
Inside a compiled region the table is traced as before (a table op per call there, a custom op
inductor cannot fuse, measured slower steps: 1.5B 0.170 -> 0.186 s with per-layer compile).

`install()` plugs it in where megatron looks for TE's function; `transformer_config` then turns
`apply_rope_fusion` on for CUDA runs of our spec. CPU runs keep megatron's unfused RoPE (the CPU tests
compare our spec with megatron's reference numerics).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor

_compiled: dict[str, Any] = {}
_tables: dict[int, tuple[Any, Tensor, Tensor]] = {}  # id(freqs) -> (weakref(freqs), cos, sin)
_MAX_TABLES = 16  # distinct sequence lengths kept (RL batches vary theirs)


def rotate_half(x: Tensor, transpose: bool = False) -> Tensor:
    """megatron's non-interleaved rotate_half, [x1, x2] -> [-x2, x1]; transpose: [x2, -x1]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x2, -x1) if transpose else (-x2, x1), dim=-1)


def _cos_sin(freqs: Tensor) -> tuple[Tensor, Tensor]:
    """cos and sin of megatron's fp32 rotary table, once per table tensor outside compiled regions."""
    if torch.compiler.is_compiling():
        return torch.cos(freqs), torch.sin(freqs)
    hit = _tables.get(id(freqs))
    if hit is not None and hit[0]() is freqs:  # the same tensor, not a new one at a reused address
        return hit[1], hit[2]
    if len(_tables) >= _MAX_TABLES:
        _tables.clear()
    cos, sin = torch.cos(freqs), torch.sin(freqs)
    _tables[id(freqs)] = (weakref.ref(freqs), cos, sin)
    return cos, sin


def _apply(t: Tensor, cos: Tensor, sin: Tensor, sign: float) -> Tensor:
    """t * cos + rotate(t) * sin over the first rot_dim features (forward: sign +1; the gradient of
    that map, applied to the incoming gradient: sign -1); features past rot_dim pass through."""
    rot = cos.shape[-1]
    x = t[..., :rot].float()
    if sign > 0:
        out = x * cos + rotate_half(x) * sin
    else:  # d/dx [x*c + R(x)*s] applied to g is g*c + R^T(g*s)
        out = x * cos + rotate_half(x * sin, transpose=True)
    out = out.to(t.dtype)
    if rot < t.shape[-1]:
        out = torch.cat((out, t[..., rot:]), dim=-1)
    return out


def _forward_kernel(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return _apply(t, cos, sin, 1.0)


def _backward_kernel(g: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return _apply(g, cos, sin, -1.0)


def _kernel(name: str, fn: Any, t: Tensor) -> Any:
    # Compiled on CUDA into one kernel each (dynamic=None: the second sequence length it sees makes it
    # shape-generic, so RL's varying lengths do not recompile); inside an outer torch.compile region
    # dynamo traces the function itself. Eager elsewhere.
    if not t.is_cuda or torch.compiler.is_compiling():
        return fn
    if name not in _compiled:
        _compiled[name] = torch.compile(fn, dynamic=None)
    return _compiled[name]


class _FusedRoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: Tensor, freqs: Tensor) -> Tensor:  # type: ignore[override]
        cos, sin = _cos_sin(freqs)
        ctx.save_for_backward(cos, sin)
        return _kernel("fwd", _forward_kernel, t)(t, cos, sin)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        return _kernel("bwd", _backward_kernel, grad)(grad.contiguous(), cos, sin), None


def fused_rope(t: Tensor, freqs: Tensor, interleaved: bool = False) -> Tensor:
    """RoPE of `t` [s, b, heads, d] with megatron's table `freqs` [s, 1, 1, rot_dim] (fp32,
    non-interleaved halves), TE's `fused_apply_rotary_pos_emb` signature."""
    if interleaved:
        raise ValueError("fused_rope: interleaved rotary embeddings are not supported (turn apply_rope_fusion off)")
    return _FusedRoPE.apply(t, freqs)


def _thd_needs_te(*args: Any, **kwargs: Any) -> Tensor:
    from trinity.models.attention import THD_NEEDS_TE

    raise ValueError(THD_NEEDS_TE)


def install() -> bool:
    """`fused_rope` as megatron's fused RoPE where TransformerEngine's is absent (trinity.compat.rope).
    Returns whether megatron now has a fused RoPE (TE's or ours)."""
    from trinity.compat import rope as compat_rope

    return compat_rope.install(fused_rope, _thd_needs_te)


__all__ = ["fused_rope", "install", "rotate_half"]
