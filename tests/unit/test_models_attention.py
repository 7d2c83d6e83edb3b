"""SDPACoreAttention against megatron-core's own DotProductAttention (local), fp32 on CPU."""

from __future__ import annotations

import pytest
import torch

from trinity.distributed.layout import ParallelLayout
from trinity.distributed.parallel import destroy, init_parallel


@pytest.fixture(scope="module")
def tp1():
    init_parallel(device="cpu", layout=ParallelLayout(), seed=3)
    yield
    destroy()


def _config(heads: int = 4, groups: int = 2, dim: int = 16):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=heads * dim, num_attention_heads=heads, num_query_groups=groups,
        kv_channels=dim, use_cpu_initialization=True, masked_softmax_fusion=False,
        attention_dropout=0.0, hidden_dropout=0.0,
    )


def _pair(config):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from trinity.models.attention import SDPACoreAttention

    kw = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    return SDPACoreAttention(**kw), DotProductAttention(**kw)


def _qkv(sq: int, sk: int, b: int = 2, heads: int = 4, groups: int = 2, dim: int = 16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sq, b, heads, dim, generator=g)
    k = torch.randn(sk, b, groups, dim, generator=g)
    v = torch.randn(sk, b, groups, dim, generator=g)
    return q, k, v


def test_causal_gqa_fast_path_matches_dot_product_attention(tp1):
    from trinity.models.attention import causal_mask

    ours, ref = _pair(_config())
    q, k, v = _qkv(12, 12)
    out = ours(q, k, v, None)  # is_causal=True path, K/V not repeated
    expected = ref(q, k, v, causal_mask(12))
    assert out.shape == (12, 2, 64)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


def test_packed_block_diagonal_mask_matches_dot_product_attention(tp1):
    from trinity.models.attention import packed_causal_mask

    ours, ref = _pair(_config())
    q, k, v = _qkv(10, 10)
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2], [0] * 6 + [1] * 4])
    mask = packed_causal_mask(doc_ids)
    torch.testing.assert_close(ours(q, k, v, mask), ref(q, k, v, mask), atol=1e-5, rtol=0)
    # The mask really separates documents: a token of doc 1 ignores doc 0 entirely.
    assert mask[0, 0, 3, :3].all() and not mask[0, 0, 4, 3:5].any()


def test_decode_step_attends_to_every_cached_key(tp1):
    from megatron.core.transformer.enums import AttnMaskType

    ours, ref = _pair(_config())
    q, k, v = _qkv(1, 9)
    no_mask = torch.zeros(1, 1, 1, 9, dtype=torch.bool)
    out = ours(q, k, v, None, attn_mask_type=AttnMaskType.no_mask)
    torch.testing.assert_close(out, ref(q, k, v, no_mask), atol=1e-5, rtol=0)


def test_queries_behind_keys_get_bottom_right_causal_mask(tp1):
    from trinity.models.attention import causal_mask

    ours, ref = _pair(_config())
    q, k, v = _qkv(3, 8)  # three new tokens after five cached ones
    torch.testing.assert_close(ours(q, k, v, None), ref(q, k, v, causal_mask(3, 8)), atol=1e-5, rtol=0)


def test_mha_without_gqa_and_gradients_match(tp1):
    from trinity.models.attention import causal_mask

    ours, ref = _pair(_config(heads=4, groups=4))
    q, k, v = (t.requires_grad_() for t in _qkv(8, 8, groups=4))
    ours(q, k, v, None).square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref(q, k, v, causal_mask(8)).square().sum().backward()
    for mine, theirs in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)


def test_dropout_is_applied_in_training_only(tp1):
    from megatron.core.transformer.enums import AttnMaskType

    from trinity.models.attention import SDPACoreAttention

    attn = SDPACoreAttention(_config(), 1, AttnMaskType.causal, "self", attention_dropout=0.5)
    q, k, v = _qkv(8, 8)
    attn.eval()
    assert torch.equal(attn(q, k, v, None), attn(q, k, v, None))
    attn.train()
    assert not torch.allclose(attn(q, k, v, None), attn(q, k, v, None))


def test_packed_seq_params_is_refused_with_a_pointer_to_the_mask(tp1):
    from megatron.core.packed_seq_params import PackedSeqParams

    ours, _ = _pair(_config())
    q, k, v = _qkv(4, 4)
    with pytest.raises(ValueError, match="document_packed_params"):
        ours(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="thd"))


def _same_outputs_and_gradients(out, expected, inputs) -> None:
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    grads = torch.autograd.grad(out.square().sum(), inputs, retain_graph=True)
    ref_grads = torch.autograd.grad(expected.square().sum(), inputs, retain_graph=True)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=0)


def test_flex_document_mask_matches_dense_packed_mask_and_gradients(tp1):
    from trinity.models.attention import document_packed_params, packed_causal_mask

    ours, ref = _pair(_config())
    q, k, v = (t.requires_grad_() for t in _qkv(20, 20))
    doc_ids = torch.tensor([[0] * 7 + [1] * 9 + [2] * 4, [0] * 20])
    out = ours(q, k, v, None, packed_seq_params=document_packed_params(doc_ids))
    expected = ref(q, k, v, packed_causal_mask(doc_ids))
    _same_outputs_and_gradients(out, expected, (q, k, v))
    # the second row is one document: plain causal attention
    torch.testing.assert_close(out[:, 1], ours(q, k, v, None)[:, 1], atol=1e-5, rtol=0)


def test_flex_block_mask_itself_matches_the_dense_mask_without_grad(tp1):
    """CPU layers use the dense form (FlexAttention has no CPU backward); check the BlockMask that CUDA
    layers use encodes the same mask by running eager FlexAttention forward."""
    from trinity.models.attention import _flex_attention, document_packed_params

    q, k, v = (t.permute(1, 2, 0, 3) for t in _qkv(20, 20))
    doc_ids = torch.tensor([[0] * 7 + [1] * 9 + [2] * 4, [3] * 20])
    params = document_packed_params(doc_ids, kernel="flex")
    with torch.no_grad():
        out = _flex_attention(q, k, v, params.block_mask, 0.25, True)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=~params.dense_mask(), scale=0.25, enable_gqa=True
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


def test_varlen_boundaries_are_bucketed_and_cpu_layers_fall_back_to_the_dense_mask(tp1):
    from trinity.models.attention import document_packed_params, packed_causal_mask

    doc_ids = torch.tensor([[0] * 7 + [1] * 9 + [-1] * 4, [0] * 3 + [1] * 17])
    params = document_packed_params(doc_ids, kernel="varlen")
    # documents of row 0 (padding is one more), then row 1's, then empty documents up to 16 boundaries
    assert params.doc_cu_seqlens.tolist() == [0, 7, 16, 20, 23] + [40] * 11
    assert params.doc_cu_seqlens.dtype == torch.int32 and params.doc_max_seqlen == 17
    assert params.max_seqlen_q == params.max_seqlen_kv == 20  # megatron sizes RoPE from these
    ours, ref = _pair(_config())
    q, k, v = _qkv(20, 20)
    torch.testing.assert_close(ours(q, k, v, None, packed_seq_params=params),
                               ref(q, k, v, packed_causal_mask(doc_ids)), atol=1e-5, rtol=0)
    many = torch.arange(40).repeat_interleave(2).view(2, 40)  # 40 documents -> 64 boundaries
    assert document_packed_params(many, kernel="varlen").doc_cu_seqlens.numel() == 64


def test_document_batches_match_the_dense_mask_and_its_gradients(tp1):
    """The CPU's `documents` kernel: each document attends within itself, as under the dense mask, in
    outputs and gradients; rows with a padding document, GQA, documents of one token."""
    from trinity.models.attention import document_packed_params, packed_causal_mask

    ours, ref = _pair(_config())
    q, k, v = (t.requires_grad_() for t in _qkv(40, 40))
    doc_ids = torch.tensor([[0] * 7 + [1] * 9 + [2] + [3] * 13 + [-1] * 10,
                            [0] * 3 + [1] * 5 + [2] * 6 + [3] * 2 + [4] * 12 + [5] * 12])
    params = document_packed_params(doc_ids)
    assert params.documents is not None and params.documents.index.shape == (11, 13)
    out = ours(q, k, v, None, packed_seq_params=params)
    expected = ref(q, k, v, packed_causal_mask(doc_ids))
    _same_outputs_and_gradients(out, expected, (q, k, v))


def test_document_batches_fall_back_to_the_dense_mask_where_that_computes_less():
    """One long document among short ones (documents x longest^2 >= b x s^2), or a document id that
    comes back later in its row (the dense mask joins the pieces): the dense mask."""
    from trinity.models.attention import document_batch, document_packed_params

    assert document_batch(torch.tensor([[0] * 30 + [1, 2, 3, 4]])) is None
    assert document_batch(torch.tensor([[0] * 4 + [1] * 4 + [0] * 4])) is None
    assert document_batch(torch.tensor([[0] * 4 + [1] * 4 + [2] * 4])) is not None
    params = document_packed_params(torch.tensor([[0] * 30 + [1, 2, 3, 4]]))
    assert params.documents is None and params.dense_mask().shape == (1, 1, 34, 34)


def test_document_packed_params_picks_the_dense_mask_on_cpu_and_refuses_unknown_kernels():
    from trinity.models.attention import document_packed_params

    params = document_packed_params(torch.zeros(1, 8, dtype=torch.long))
    assert params.doc_cu_seqlens is None and params.block_mask is None and params.documents is None
    assert params.dense_mask().shape == (1, 1, 8, 8)
    with pytest.raises(ValueError, match="kernel='fast'.*varlen"):
        document_packed_params(torch.zeros(1, 8, dtype=torch.long), kernel="fast")


def test_sliding_window_in_every_kernel_matches_dot_product_attention_with_the_window_mask(tp1):
    """window_size=(W-1, 0): a query sees itself and the W-1 keys before it (HF's sliding_window W) in the
    causal fast path, under an explicit mask, a decode step's bottom-right mask, and packed rows through
    the documents kernel (padding included) and the dense mask; gradients stay finite."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from trinity.models.attention import (SDPACoreAttention, causal_mask, document_packed_params, outside_window,
                                          packed_causal_mask)

    cfg = _config()
    cfg.window_size = (2, 0)
    ours = SDPACoreAttention(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    plain = _config()
    ref = DotProductAttention(config=plain, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    q, k, v = _qkv(12, 12)
    windowed = causal_mask(12) | outside_window(12, 2)
    expected = ref(q, k, v, windowed)
    torch.testing.assert_close(ours(q, k, v, None), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours(q, k, v, causal_mask(12)), expected, atol=1e-5, rtol=0)
    assert not torch.allclose(ref(q, k, v, causal_mask(12)), expected, atol=1e-3)  # the window matters here
    step = ours(q[-1:], k, v, None)  # one query behind 12 keys
    torch.testing.assert_close(step, expected[-1:], atol=1e-5, rtol=0)
    doc_ids = torch.tensor([[0] * 7 + [1] * 5, [0] * 3 + [1] * 6 + [-1] * 3])
    dense = ref(q, k, v, packed_causal_mask(doc_ids) | outside_window(12, 2))
    packed = document_packed_params(doc_ids)
    assert packed.documents is not None
    q.requires_grad_(True)
    out = ours(q, k, v, None, packed_seq_params=packed)
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=0)
    out.square().sum().backward()
    assert torch.isfinite(q.grad).all()
    torch.testing.assert_close(ours(q, k, v, packed_causal_mask(doc_ids)), dense, atol=1e-5, rtol=0)
