"""Attention over packed rows from their `doc_ids` [b, s] (trinity.data.packing; -1 = padding): the
block-diagonal causal mask in megatron's convention for our SDPA attention, and the same boundaries as
cumulative sequence lengths for varlen kernels (THD / flash-attn)."""

from __future__ import annotations

import torch


def block_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """Attention mask [b, 1, s, s] from doc_ids [b, s], in megatron's convention (True = masked out).

    A token sees earlier tokens of its own document. A padding token sees only itself: a query row
    with every key masked gives NaN in softmax, which would poison gradients even with loss_mask 0.
    """
    s = doc_ids.shape[-1]
    real = doc_ids >= 0
    causal = torch.ones(s, s, dtype=torch.bool, device=doc_ids.device).tril_()
    allowed = (doc_ids[:, :, None] == doc_ids[:, None, :]) & causal & real[:, :, None]
    allowed |= (~real)[:, :, None] & torch.eye(s, dtype=torch.bool, device=doc_ids.device)
    return (~allowed)[:, None]


def cu_seqlens(doc_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Cumulative sequence lengths (int32, starting at 0) over the rows of doc_ids [b, s], flattened.

    Each document is one sequence and a row's padding is one more, so the lengths sum to b * s
    (the THD layout of megatron's PackedSeqParams / flash-attn varlen). Returns (cu_seqlens, max_seqlen).
    """
    b, s = doc_ids.shape
    flat = doc_ids.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[::s] = True  # a new row always starts a new sequence
    bounds = torch.nonzero(starts).flatten()
    cu = torch.cat([bounds, bounds.new_tensor([b * s])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max()) if b * s else 0
