"""Layer-level options of our spec that megatron-core's TransformerLayer does not have (Gemma).

- `ZeroCenteredRMSNorm`: RMSNorm that scales by (1 + weight), computed in fp32 and cast back, as
  Gemma's norm (transformers' Gemma2RMSNorm / Gemma3RMSNorm). The parameter holds the HF weight as is
  (zero = identity scale), so conversion copies it and the round trip stays bit-exact; megatron names
  this `layernorm_zero_centered_gamma`.
- `TransformerLayer`: megatron's layer plus two options.
  * Sandwich norms: `post_self_attn_layernorm` / `post_mlp_layernorm` normalise the attention and MLP
    outputs before their residual adds (Gemma's post_attention_layernorm / post_feedforward_layernorm).
    megatron's layer adds each output to the residual in its bias-dropout-add (`self_attn_bda`,
    `mlp_bda`); the post norm runs first inside that call, so the rest of megatron's layer (recompute,
    offloading, inference) is unchanged.
  * `rotary_base`: this layer's own RoPE table, in place of the model's (Gemma 3's sliding layers use
    `rope_local_base_freq`, its global layers `rope_theta`). The table is megatron's RotaryEmbedding,
    of the length of the one the model passes in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer as MegatronTransformerLayer
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules


class ZeroCenteredRMSNorm(torch.nn.Module):
    """x / rms(x) * (1 + weight) in fp32, cast back to x's dtype (Gemma's RMSNorm, same ops)."""

    def __init__(self, hidden_size: int, eps: float, *, device: Any = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.normalized_shape = (hidden_size,)
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


@dataclass
class LayerSubmodules(TransformerLayerSubmodules):
    post_self_attn_layernorm: Union[ModuleSpec, type] = IdentityOp
    post_mlp_layernorm: Union[ModuleSpec, type] = IdentityOp


def _normed(bda: Callable[..., torch.Tensor], norm: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """megatron's bias-dropout-add with `norm` applied to the branch output (bias included) first."""

    def run(out_with_bias: tuple[torch.Tensor, Optional[torch.Tensor]], residual: torch.Tensor, prob: float) -> torch.Tensor:
        out, bias = out_with_bias
        if bias is not None:
            out = out + bias
        return bda((norm(out), None), residual, prob)

    return run


class TransformerLayer(MegatronTransformerLayer):
    """megatron's TransformerLayer with optional sandwich norms and its own RoPE base (module doc)."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: LayerSubmodules,
        layer_number: int = 1,
        hidden_dropout: Optional[float] = None,
        pg_collection: Any = None,
        vp_stage: Optional[int] = None,
        rotary_base: Optional[float] = None,
    ):
        super().__init__(config, submodules, layer_number, hidden_dropout, pg_collection, vp_stage)
        norm_args = dict(config=self.config, hidden_size=self.config.hidden_size, eps=self.config.layernorm_epsilon)
        self.post_self_attn_layernorm = build_module(submodules.post_self_attn_layernorm, **norm_args)
        self.post_mlp_layernorm = build_module(submodules.post_mlp_layernorm, **norm_args)
        self.sandwich = not isinstance(self.post_self_attn_layernorm, IdentityOp)
        if self.sandwich:
            self._attn_bda, self._mlp_bda = self.self_attn_bda, self.mlp_bda
            self.self_attn_bda = self._post_attention_bda
            self.mlp_bda = self._post_mlp_bda
        self.rotary = None
        if rotary_base is not None:
            self.rotary = RotaryEmbedding(
                kv_channels=config.kv_channels, rotary_percent=1.0, rotary_interleaved=config.rotary_interleaved,
                rotary_base=rotary_base, use_cpu_initialization=config.use_cpu_initialization,
            )

    def _post_attention_bda(self, training: bool, fused: bool) -> Callable[..., torch.Tensor]:
        return _normed(self._attn_bda(training, fused), self.post_self_attn_layernorm)

    def _post_mlp_bda(self, training: bool, fused: bool) -> Callable[..., torch.Tensor]:
        return _normed(self._mlp_bda(training, fused), self.post_mlp_layernorm)

    def rope_table(self, table: torch.Tensor) -> torch.Tensor:
        """This layer's RoPE table [s, 1, 1, d] for the model's `table` of the same length."""
        return table if self.rotary is None else self.rotary(table.size(0))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        table = kwargs.get("rotary_pos_emb")
        if self.rotary is not None and isinstance(table, torch.Tensor):
            kwargs["rotary_pos_emb"] = self.rope_table(table)
        return super().forward(*args, **kwargs)


__all__ = ["LayerSubmodules", "TransformerLayer", "ZeroCenteredRMSNorm"]
