"""trinity.models.rope against megatron-core's unfused RoPE (fp32 on CPU: forward and gradient)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("rot_dim", [16, 8])  # full and partial rotary
def test_fused_rope_matches_megatron_unfused_forward_and_backward(rot_dim):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from trinity.models.rope import fused_rope

    g = torch.Generator().manual_seed(0)
    s, b, heads, d = 11, 2, 3, 16
    half = torch.randn(s, 1, 1, rot_dim // 2, generator=g) * 3
    freqs = torch.cat((half, half), dim=-1)  # megatron's non-interleaved table layout
    t = torch.randn(s, b, heads, d, generator=g, requires_grad=True)
    grad = torch.randn(s, b, heads, d, generator=g)

    ref = _apply_rotary_pos_emb_bshd(t, freqs)
    (ref_grad,) = torch.autograd.grad(ref, t, grad)
    out = fused_rope(t, freqs)
    (out_grad,) = torch.autograd.grad(out, t, grad)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(out_grad, ref_grad, atol=1e-6, rtol=0)
    assert not torch.equal(out_grad, grad)  # the rotation did something


def test_install_makes_megatron_use_fused_rope_and_thd_fails_clearly():
    from megatron.core.models.common.embeddings import rope_utils

    from trinity.models import rope

    assert rope.install()
    if rope_utils.fused_apply_rotary_pos_emb is rope.fused_rope:  # no TransformerEngine here
        with pytest.raises(ValueError, match="thd format needs TransformerEngine"):
            rope_utils.fused_apply_rotary_pos_emb_thd(torch.zeros(1), None, None)
    with pytest.raises(ValueError, match="interleaved"):
        rope.fused_rope(torch.zeros(2, 1, 1, 4), torch.zeros(2, 1, 1, 4), interleaved=True)


def test_cos_sin_are_computed_once_per_rotary_table_tensor():
    """Eager layers share megatron's (lru-cached) table: its cos/sin are computed on the first layer
    only; another table tensor, even with the same values, gets its own."""
    from trinity.models import rope

    rope._tables.clear()
    freqs = torch.rand(6, 1, 1, 4) * 50
    first = rope._cos_sin(freqs)
    assert rope._cos_sin(freqs)[0] is first[0] and len(rope._tables) == 1
    torch.testing.assert_close(first[0], torch.cos(freqs), rtol=0, atol=0)
    torch.testing.assert_close(first[1], torch.sin(freqs), rtol=0, atol=0)
    other = freqs.clone()
    assert rope._cos_sin(other)[0] is not first[0] and len(rope._tables) == 2
    t = torch.randn(6, 2, 3, 8, requires_grad=True)
    rope.fused_rope(t, freqs).sum().backward()  # forward and backward take the cached table
    assert len(rope._tables) == 2 and t.grad is not None
