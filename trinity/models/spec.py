"""Layer specs: TransformerEngine's when it imports, otherwise ours (megatron's local spec with SDPA).

Our spec is `get_gpt_layer_local_spec(normalization="RMSNorm")` with two substitutions:
- core attention: `trinity.models.attention.SDPACoreAttention` instead of DotProductAttention (at
  context_parallel_size > 1 `trinity.models.ring_attention.RingCoreAttention`, ring attention over the CP
  group; with TransformerEngine, `backend` picks TE's spec and megatron-core's own CP attention);
- norms: `TorchNorm` instead of megatron's WrappedTorchNorm, which refuses sequence parallel (only
  apex/TE norms are allowed, and neither is installed on our CPUs or GPUs). Under SP a norm acts on
  each rank's sequence shard independently, so the torch module is correct as is; its params are tagged
  `sequence_parallel` so finalize_model_grads sums their TP-partial grads, as megatron does for apex.

Parameter names our spec produces (per layer N, 0-based within the chunk; MoE layers replace `mlp.*`):
    embedding.word_embeddings.weight                      (pre_process chunks)
    decoder.layers.N.input_layernorm.weight
    decoder.layers.N.self_attention.linear_qkv.weight     (+ .bias when add_qkv_bias)
    decoder.layers.N.self_attention.q_layernorm.weight    (qk_layernorm: Qwen3)
    decoder.layers.N.self_attention.k_layernorm.weight
    decoder.layers.N.self_attention.linear_proj.weight
    decoder.layers.N.self_attention.post_layernorm.weight (post_block_norms: GLM-4)
    decoder.layers.N.pre_mlp_layernorm.weight
    decoder.layers.N.mlp.post_layernorm.weight            (post_block_norms, dense layers)
    decoder.layers.N.mlp.linear_fc1.weight                (dense; gate and up stacked: [2*ffn, h])
    decoder.layers.N.mlp.linear_fc2.weight
    decoder.layers.N.mlp.router.weight                    (MoE)
    decoder.layers.N.mlp.experts.local_experts.E.linear_fc1.weight   (MoE, moe_grouped_gemm=False)
    decoder.layers.N.mlp.experts.local_experts.E.linear_fc2.weight
    decoder.layers.N.mlp.experts.weight1 / weight2                    (MoE, moe_grouped_gemm=True)
    decoder.layers.N.self_attention.linear_q_proj.weight / linear_q_down_proj / linear_q_up_proj,
        q_layernorm, linear_kv_down_proj, kv_layernorm, linear_kv_up_proj   (MLA, instead of linear_qkv)
    decoder.layers.N.mlp.shared_experts.linear_fc1.weight / linear_fc2.weight   (shared experts)
    decoder.layers.N.mlp.router.expert_bias               (a buffer: sigmoid routing's score correction)
    decoder.final_layernorm.weight                        (post_process chunks)
    output_layer.weight                                   (post_process chunks, untied or value head)
With TransformerEngine the two layer norms are fused instead: `self_attention.linear_qkv.layer_norm_weight`
and `mlp.linear_fc1.layer_norm_weight` (dense layers).

Gemma (`facts.gemma`) adds per layer `post_self_attn_layernorm.weight` and `post_mlp_layernorm.weight`
(sandwich norms, trinity.models.layer.TransformerLayer), its norms scale by (1 + weight)
(`ZeroCenteredRMSNorm`), its core attention caps the scores (`softcap`), and Gemma 3's sliding layers
have their own RoPE base. Layers differ (sliding / global), so `block_spec` builds one spec per layer from
`layer_spec(..., layer=i)`; the sliding window itself is megatron's config (`window_size`,
`window_attn_skip_freq`, trinity.models.attention). TransformerEngine's spec has none of these: Gemma
always runs our spec.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util

import torch
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
)
from megatron.core.transformer.attention import SelfAttention
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from trinity.compat import te_absent
from trinity.models.attention import SDPACoreAttention, mla_self_attention
from trinity.models.facts import ModelFacts
from trinity.models.ring_attention import RingCoreAttention
from trinity.models.layer import LayerSubmodules, TransformerLayer, ZeroCenteredRMSNorm

BACKEND_TE = "transformer_engine"
BACKEND_LOCAL_SDPA = "local+sdpa"


def have_transformer_engine() -> bool:
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # an installed but broken TE (wrong CUDA) must not stop us: use our spec
        return False
    return True


def backend(config: TransformerConfig, facts: ModelFacts | None = None) -> str:
    """The layer implementation build_model uses: TE on CUDA when it imports, else ours. Always ours for a
    model with a feature only ours has (`needs_local_spec`)."""
    if (facts is not None and needs_local_spec(facts)) or getattr(config, "multi_latent_attention", False):
        return BACKEND_LOCAL_SDPA
    if not config.use_cpu_initialization and torch.cuda.is_available() and have_transformer_engine():
        return BACKEND_TE
    return BACKEND_LOCAL_SDPA


class TorchNorm:
    """torch.nn.RMSNorm / LayerNorm built from the config, allowed under sequence parallel."""

    def __new__(  # same call signature megatron uses for its norm classes
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        norms = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}
        if config.normalization not in norms:
            raise ValueError(f"normalization {config.normalization!r}: one of {sorted(norms)}")
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        if config.layernorm_zero_centered_gamma:
            if config.normalization != "RMSNorm":
                raise ValueError("layernorm_zero_centered_gamma: our torch norms have it for RMSNorm only")
            norm = ZeroCenteredRMSNorm(hidden_size, eps, device=device, dtype=config.params_dtype)
        else:
            norm = norms[config.normalization](
                normalized_shape=hidden_size, eps=eps, device=device, dtype=config.params_dtype
            )
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


class _PostNorm:
    """Mixin: RMSNorm of the block's output before the residual add (GLM-4's post_self_attn_layernorm and
    post_mlp_layernorm; megatron-core's TransformerLayer has no such norm). `post_layernorm` is a child of
    the attention / MLP module, so recompute, PP and the checkpoints carry it with the block."""

    def _add_post_norm(self, config: TransformerConfig) -> None:
        self.post_layernorm = TorchNorm(config, config.hidden_size, eps=config.layernorm_epsilon)

    def _post_norm(self, out: tuple) -> tuple:
        output, bias = out[0], out[1]
        if bias is not None:  # GLM-4's projections have no bias; a bias would be added after the norm
            raise ValueError("post_block_norms needs add_bias_linear=False")
        return (self.post_layernorm(output), None, *out[2:])


class PostNormSelfAttention(_PostNorm, SelfAttention):
    def __init__(self, config: TransformerConfig, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self._add_post_norm(config)

    def forward(self, *args, **kwargs):  # type: ignore[override]
        return self._post_norm(super().forward(*args, **kwargs))


class PostNormMLP(_PostNorm, MLP):
    """Given to the layer spec as a class, not a ModuleSpec: megatron's TransformerLayer warns on every
    layer about MLP specs of classes it does not know (the TP group is the default one either way)."""

    def __init__(self, config: TransformerConfig, submodules: MLPSubmodules | None = None, **kwargs) -> None:
        local = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
        super().__init__(config, submodules or local, **kwargs)
        self._add_post_norm(config)

    def forward(self, *args, **kwargs):  # type: ignore[override]
        return self._post_norm(super().forward(*args, **kwargs))

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        # MLP's asks every child for its own sharded_state_dict, which a torch norm does not have: the norm
        # is left out of that loop and saved as megatron saves its other torch norms (replicated over TP)
        from megatron.core.transformer.utils import sharded_state_dict_default

        norm = self._modules.pop("post_layernorm")
        try:
            out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        finally:
            self._modules["post_layernorm"] = norm
        out.update(sharded_state_dict_default(norm, f"{prefix}post_layernorm.", sharded_offsets, metadata))
        return out


def post_norm(module: torch.nn.Module) -> torch.nn.Module | None:
    """The block-output norm of an attention / MLP module (post_block_norms), None without one: the
    rollout decoders, which call a block's linears themselves, apply it from here."""
    return getattr(module, "post_layernorm", None)


def needs_local_spec(facts: ModelFacts) -> bool:
    """Features only our spec has (TransformerEngine's layer spec would silently drop them): GLM-4's
    post-block norms, Gemma's sandwich norms and score caps, and MLA (TE's MLA spec keeps the q/kv down
    projections whole on every TP rank, ours splits them, and one layout keeps one weight map)."""
    return facts.post_block_norms or facts.gemma or facts.mla is not None


def layer_spec(facts: ModelFacts, config: TransformerConfig, layer: int = 0) -> ModuleSpec:
    """Our transformer-layer spec for global layer `layer` (0-based) of `facts`: the same for every
    layer except Gemma's sliding / global options and DeepSeek's first `moe_dense_layers` dense layers."""
    te_absent.install(have_transformer_engine())
    moe = facts.is_moe and layer >= facts.moe_dense_layers
    mla = facts.mla is not None
    spec = get_gpt_layer_local_spec(
        num_experts=facts.num_experts if moe else None,
        moe_grouped_gemm=config.moe_grouped_gemm,
        qk_layernorm=config.qk_layernorm,
        multi_latent_attention=mla,
        normalization="RMSNorm",
    )
    spec = copy.deepcopy(spec)  # megatron's spec objects are shared between calls
    sub = spec.submodules
    sub.input_layernorm = TorchNorm
    sub.pre_mlp_layernorm = TorchNorm
    attn = sub.self_attention.submodules
    # context parallelism without TransformerEngine: ring attention over the CP group (validation refuses
    # what it lacks: score caps, sliding windows, attention dropout)
    attn.core_attention = RingCoreAttention if config.context_parallel_size > 1 else SDPACoreAttention
    if moe and facts.moe_group_score_topk:  # DeepSeek's group-limited routing, as transformers ranks groups
        from trinity.models.moe_router import GroupScoreRouter

        sub.mlp.submodules.router = functools.partial(GroupScoreRouter, group_score_topk=facts.moe_group_score_topk)
    if mla:  # the RMSNorms on MLA's q and kv latents (q_a_layernorm, kv_a_layernorm)
        sub.self_attention.module = mla_self_attention()
        attn.q_layernorm = TorchNorm
        attn.kv_layernorm = TorchNorm
    elif config.qk_layernorm:
        attn.q_layernorm = TorchNorm
        attn.k_layernorm = TorchNorm
    if facts.post_block_norms:
        if facts.is_moe:
            raise ValueError("post_block_norms: MoE layers are not supported")
        sub.self_attention.module = PostNormSelfAttention
        sub.mlp = PostNormMLP
    if not facts.gemma:
        return spec
    # the sliding window is the config's (window_size, window_attn_skip_freq); the score cap and a
    # sliding layer's own RoPE base are this layer's options
    if facts.attn_logit_softcapping is not None:
        attn.core_attention = ModuleSpec(module=SDPACoreAttention, params={"softcap": facts.attn_logit_softcapping})
    local_base = facts.rope_local_theta if facts.is_sliding(layer) else None
    return ModuleSpec(
        module=TransformerLayer,
        params={"rotary_base": local_base} if local_base is not None else {},
        submodules=LayerSubmodules(
            **{f.name: getattr(sub, f.name) for f in dataclasses.fields(sub)},
            post_self_attn_layernorm=TorchNorm,
            post_mlp_layernorm=TorchNorm,
        ),
    )


def block_spec(
    facts: ModelFacts, config: TransformerConfig, *, vp_stage: int | None, pp_rank: int | None = None
) -> TransformerBlockSubmodules:
    """The decoder-block spec for one model chunk (the layers of this PP rank / VPP stage)."""
    if backend(config, facts) == BACKEND_TE:
        return get_gpt_decoder_block_spec(
            config, use_transformer_engine=True, normalization="RMSNorm", vp_stage=vp_stage, pp_rank=pp_rank
        )
    n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    first = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(
        layer_specs=[layer_spec(facts, config, first + i) for i in range(n)], layer_norm=TorchNorm
    )


def layer_offset(config: TransformerConfig, *, vp_stage: int | None) -> int:
    """Global index of a chunk's first layer (HF layer = offset + local index)."""
    return get_transformer_layer_offset(config, vp_stage=vp_stage)


__all__ = [
    "BACKEND_LOCAL_SDPA", "BACKEND_TE", "PostNormMLP", "PostNormSelfAttention", "TorchNorm", "backend",
    "block_spec", "layer_offset", "layer_spec", "have_transformer_engine", "needs_local_spec", "post_norm",
]
