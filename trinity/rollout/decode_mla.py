"""Multi-latent attention (DeepSeek-V2/V3) in the rollout decoders.

The decoders cache per-head keys and values: for MLA each layer's keys and values are computed from the
latent (kv_b expansion, decoupled RoPE key broadcast to every head) and cached like grouped attention
with one head per group (keys qk_nope + qk_rope wide, values v_head_dim wide). That is exact and reuses
the decoders' cache, masks and SDPA calls; caching the latent instead would take
(kv_lora_rank + qk_rope) per token rather than heads * (qk + v), at the price of absorbing kv_b into the
query and output, which is left out. MLA layers take the module path (megatron's submodules), without
CUDA graphs or the Triton split-KV / fused-RoPE kernels (their keys and values have one width).

The arithmetic follows megatron's `MLASelfAttention.get_query_key_value_tensors` (unfused RoPE, no
sequence parallel: the rollout runs without it) with the rotary angles of the cached positions instead
of 0..s-1.
"""

from __future__ import annotations

from typing import Any

import torch


def is_mla(gpt: Any) -> bool:
    return bool(getattr(gpt.config, "multi_latent_attention", False))


def rotary(gpt: Any, cache_len: int) -> tuple[torch.Tensor, float]:
    """The first layer's rotary table [cache_len, 1, 1, rot] and YaRN's cos/sin factor (1 for plain RoPE);
    MLA layers hold their own RoPE (GPTModel has none with MLA)."""
    emb = gpt.decoder.layers[0].self_attention.rotary_pos_emb(cache_len)
    if isinstance(emb, tuple):  # YarnRotaryEmbedding: (table, mscale)
        return emb[0], float(emb[1])
    return emb, 1.0


def head_dims(attn: Any) -> tuple[int, int]:
    """(key/query head size, value head size) of an MLA layer."""
    return attn.q_head_dim, attn.config.v_head_dim


def _gathered(x: torch.Tensor, width: int) -> torch.Tensor:
    """A column-parallel down projection's output, gathered over TP where it is split (as megatron's MLA)."""
    if x.size(-1) == width:
        return x
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(x)


def qkv(attn: Any, hidden: torch.Tensor, freqs: torch.Tensor, mscale: float
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k [s, b, heads, qk_nope + qk_rope] and v [s, b, heads, v_head_dim] of this TP rank's heads, for
    hidden [s, b, h] at the rotary angles `freqs` [s, b | 1, 1, rot]."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    cfg = attn.config
    s, b = hidden.shape[:2]
    n = attn.num_attention_heads_per_partition
    if cfg.q_lora_rank is None:
        q, _ = attn.linear_q_proj(hidden)
    else:
        q_lat, _ = attn.linear_q_down_proj(hidden)
        q, _ = attn.linear_q_up_proj(attn.q_layernorm(_gathered(q_lat, cfg.q_lora_rank)))
    q = q.view(s, b, n, attn.q_head_dim)
    kv_lat, _ = attn.linear_kv_down_proj(hidden)
    kv_lat = _gathered(kv_lat, cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim)
    kv_c, k_pe = torch.split(kv_lat, [cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim], dim=-1)
    kv, _ = attn.linear_kv_up_proj(attn.kv_layernorm(kv_c))
    kv = kv.view(s, b, n, cfg.qk_head_dim + cfg.v_head_dim)
    q_nope, q_pe = torch.split(q, [cfg.qk_head_dim, cfg.qk_pos_emb_head_dim], dim=-1)
    k_nope, v = torch.split(kv, [cfg.qk_head_dim, cfg.v_head_dim], dim=-1)
    q_pe = apply_rotary_pos_emb(q_pe, freqs, config=cfg, mscale=mscale)
    k_pe = apply_rotary_pos_emb(k_pe.unsqueeze(-2), freqs, config=cfg, mscale=mscale)
    q = torch.cat([q_nope, q_pe], dim=-1)
    k = torch.cat([k_nope, k_pe.expand(-1, -1, n, -1)], dim=-1)
    return q, k, v.contiguous()
