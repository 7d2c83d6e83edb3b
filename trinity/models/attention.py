"""Core attention on torch's scaled_dot_product_attention, a drop-in for megatron's DotProductAttention.

megatron-core's local DotProductAttention materialises the [b, heads, s, s] score matrix and repeats
K/V for GQA; without TransformerEngine that is the only local option. SDPA dispatches to the flash /
memory-efficient kernels on CUDA (and a fused kernel on CPU), which the lent GPUs measured at 2.6x the
step throughput at 0.9B and a quarter of the memory (docs/../shared notes gpu-measurements).

Conventions are megatron's: q [sq, b, heads, d], k/v [sk, b, groups, d], output [sq, b, heads*d];
`attention_mask` is boolean with True = masked out, broadcastable to [b, 1|heads, sq, sk].
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide

# Mask types whose meaning with attention_mask=None is "causal".
_CAUSAL_TYPES = (AttnMaskType.causal,)


def causal_mask(sq: int, sk: int | None = None, device: torch.device | str = "cpu") -> Tensor:
    """Boolean causal mask, True = masked, shape [1, 1, sq, sk]; queries are the last sq positions
    of the sk keys (bottom-right aligned, as during cached decoding)."""
    sk = sq if sk is None else sk
    q_pos = torch.arange(sk - sq, sk, device=device).unsqueeze(1)
    k_pos = torch.arange(sk, device=device).unsqueeze(0)
    return (k_pos > q_pos).view(1, 1, sq, sk)


def packed_causal_mask(doc_ids: Tensor) -> Tensor:
    """Block-diagonal causal mask for packed rows: `doc_ids` [b, s] holds each token's document
    index; a token sees earlier tokens of its own document only. Returns [b, 1, s, s], True = masked."""
    same_doc = doc_ids.unsqueeze(2) == doc_ids.unsqueeze(1)
    s = doc_ids.size(1)
    return ~same_doc.unsqueeze(1) | causal_mask(s, device=doc_ids.device)


class SDPACoreAttention(MegatronModule):
    """Same constructor and forward as megatron-core's DotProductAttention (plugs into SelfAttention)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("context parallelism needs TransformerEngine's attention; SDPA runs CP=1")
        if config.softmax_type != "vanilla":
            raise ValueError(f"softmax_type={config.softmax_type!r} is not supported by SDPACoreAttention")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise ValueError("sliding-window attention is not supported by SDPACoreAttention")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        tp = pg_collection.tp.size()
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, tp)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp)
        # apply_query_key_layer_scaling divides the scale by the layer number and multiplies it back in
        # fp32 inside the softmax (an fp16 overflow guard): the net scale is the plain one.
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        )
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by SDPACoreAttention")
        if packed_seq_params is not None:
            raise ValueError(
                "packed_seq_params needs TransformerEngine; pass a block-diagonal attention_mask "
                "(trinity.models.attention.packed_causal_mask) instead"
            )
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        sq, b, heads, d = query.shape
        sk = key.size(0)
        q = query.permute(1, 2, 0, 3)  # [b, heads, sq, d]
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        is_causal = False
        mask = None
        if attention_mask is not None:
            mask = ~attention_mask  # SDPA: True = attend
        elif mask_type in _CAUSAL_TYPES:
            if sq == sk:
                is_causal = True  # fast path: no mask tensor, flash kernel on CUDA
            else:
                mask = ~causal_mask(sq, sk, device=query.device)
        # GQA without repeating K/V. With a mask too this stays on a fused kernel: on an H100 (torch
        # 2.11, s=4096, 28/4 heads, d=128, bf16) masked fwd+bwd took 2.89 ms with enable_gqa and
        # 2.98 ms with K/V repeated; causal without a mask 1.04 ms.
        enable_gqa = heads != k.size(1)
        dropout_p = self.dropout_p if self.training else 0.0

        def attend() -> Tensor:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                scale=self.softmax_scale, enable_gqa=enable_gqa,
            )

        if dropout_p > 0.0 and not self.config.sequence_parallel:
            # As DotProductAttention: heads differ per TP rank, so dropout draws from the TP stream.
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = attend()
        else:
            out = attend()
        # [b, heads, sq, d] -> [sq, b, heads*d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)
