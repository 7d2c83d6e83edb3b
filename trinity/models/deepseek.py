"""DeepSeek-V2 / V3 (transformers 5.24's DeepseekV2/V3ForCausalLM) on megatron-core: what their
config.json means in megatron-core's terms, and what is refused because megatron-core computes it
differently.

- Attention: multi-latent attention, megatron-core's MLASelfAttention (MLATransformerConfig). HF
  rotates the decoupled RoPE part as interleaved pairs (V2 always, V3 with `rope_interleave: true`);
  megatron's MLA RoPE de-interleaves q_pe/k_pe first ([x0, x2, ..; x1, x3, ..]) and rotates halves,
  which gives HF's rotated pairs in a fixed permutation applied to q and k alike: the scores are the
  same, so the HF weights load unpermuted (as mbridge's and Megatron-Bridge's DeepSeek bridges do).
  `rope_interleave: false` (halves rotated without de-interleaving) would need the rope rows permuted:
  refused. YaRN: megatron's YarnRotaryEmbedding with HF's factor, beta_fast/slow, mscale and
  mscale_all_dim (cos/sin scaled by mscale/mscale_all_dim, softmax by mscale_all_dim^2, as HF).
- MLP: `first_k_dense_replace` dense layers, then MoE layers (`moe_layer_freq` as a list) with
  `n_shared_experts * moe_intermediate_size` shared experts.
- Routing: V2 softmax over all experts, top-k without renormalisation (transformers 5.24's V2 router
  ignores norm_topk_prob) times routed_scaling_factor; V3 sigmoid + e_score_correction_bias (megatron's
  `expert_bias` buffer, frozen: bias update rate 0, HF keeps it a buffer too), renormalised top-k.
  Group-limited routing ranks a group as HF does (V2 `group_limited_greedy`: its top score, V3: the sum
  of its top 2), through trinity.models.moe_router (megatron's own uses top_k // topk_group); no group
  limit is needed when topk_group >= n_group.
- V3's multi-token-prediction layers (`num_nextn_predict_layers`): transformers 5.24 does not build
  them either (it drops `model.layers.<num_hidden_layers>.*` on load); trinity trains the main model,
  leaves those tensors unloaded (logged) and exports none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trinity.errors import UserError


@dataclass(frozen=True)
class MLAFacts:
    """Multi-latent attention geometry (DeepSeek-V2/V3), HF names."""

    q_lora_rank: int | None  # None: q_proj straight from the hidden state (V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


_YARN_KEYS = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
              "beta_slow", "mscale", "mscale_all_dim", "truncate"}


def read_deepseek(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The DeepSeek fields of ModelFacts from an HF config dict; UserError naming the field for what
    megatron-core would compute differently from transformers."""
    arch = (raw.get("architectures") or ["?"])[0]
    v3 = arch == "DeepseekV3ForCausalLM"

    def need(key: str) -> Any:
        if raw.get(key) is None:
            raise UserError(f"{source}: missing required field {key!r} for {arch}")
        return raw[key]

    def refuse(field: str, why: str) -> UserError:
        return UserError(f"{source}: {field}: {why}")

    if raw.get("quantization_config"):
        raise refuse("quantization_config", "quantized checkpoints (e.g. DeepSeek-V3's FP8 release) are not "
                     "supported; convert the weights to bf16 first")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise refuse(flag, "true is not supported for DeepSeek (megatron-core's MLA and MLP have no biases)")
    if v3 and raw.get("rope_interleave") is False:
        raise refuse("rope_interleave", "false is not supported (megatron-core's MLA rotates interleaved pairs)")
    q_lora = raw.get("q_lora_rank")
    mla = MLAFacts(
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(need("kv_lora_rank")),
        qk_nope_head_dim=int(need("qk_nope_head_dim")),
        qk_rope_head_dim=int(need("qk_rope_head_dim")),
        v_head_dim=int(need("v_head_dim")),
    )
    head_dim = raw.get("head_dim")
    if head_dim is not None and int(head_dim) != mla.qk_rope_head_dim:
        # transformers' rotary table has head_dim features and rotates the qk_rope_head_dim ones with it
        raise refuse("head_dim", f"{head_dim} differs from qk_rope_head_dim {mla.qk_rope_head_dim}; transformers' "
                     "DeepSeek sizes its RoPE by head_dim, so the two must be equal")
    _check_rope(raw, source)
    layers = int(need("num_hidden_layers"))
    topk = int(need("num_experts_per_tok"))
    experts = int(need("n_routed_experts"))
    n_group, topk_group = raw.get("n_group"), raw.get("topk_group")
    groups = group_topk = None
    if v3:
        # HF V3 always takes the group-limited path: each group scored by its top-2 sum
        grouped, per_group_score = True, 2
        score, bias = "sigmoid", True
        norm = bool(raw.get("norm_topk_prob", True))
        if norm != (topk > 1):
            raise refuse("norm_topk_prob", f"{norm} with num_experts_per_tok={topk} is not supported "
                         "(megatron-core's sigmoid router renormalises exactly when top_k > 1)")
    else:
        method = raw.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise refuse("topk_method", f"{method!r} is not supported (greedy, group_limited_greedy)")
        grouped, per_group_score = method == "group_limited_greedy", 1  # HF V2 scores a group by its max
        score, bias, norm = "softmax", False, False
    if grouped:
        if not n_group or not topk_group:
            raise refuse("n_group", "group-limited routing needs n_group and topk_group")
        n_group, topk_group = int(n_group), int(topk_group)
        if experts % n_group or experts // n_group < per_group_score:
            raise refuse("n_group", f"{n_group} groups of {experts} experts: transformers scores a group by its "
                         f"top {per_group_score}, so each group needs at least that many experts")
        if topk_group < n_group:  # else every group is eligible: plain top-k
            groups, group_topk = n_group, topk_group
    shared = int(raw.get("n_shared_experts") or 0)
    moe_ffn = int(need("moe_intermediate_size"))
    return dict(
        mla=mla,
        moe_dense_layers=min(int(raw.get("first_k_dense_replace") or 0), layers),
        moe_shared_ffn_hidden_size=shared * moe_ffn or None,
        moe_score_function=score,
        moe_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
        moe_num_groups=groups,
        moe_group_topk=group_topk,
        moe_group_score_topk=per_group_score if groups else None,
        moe_expert_bias=bias,
        moe_norm_topk_prob=norm,
        mtp_layers=int(raw.get("num_nextn_predict_layers") or 0) if v3 else 0,
    )


def _rope_params(raw: dict[str, Any]) -> dict[str, Any] | None:
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    kind = params.get("rope_type") or params.get("type") or "default"
    return None if kind == "default" else params


def _check_rope(raw: dict[str, Any], source: str) -> None:
    rs = _rope_params(raw)
    if rs is None:
        return
    kind = rs.get("rope_type") or rs.get("type")
    field = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    if kind != "yarn":
        raise UserError(f"{source}: {field}: rope type {kind!r} is not supported for DeepSeek (default, yarn)")
    unknown = sorted(set(rs) - _YARN_KEYS)
    if unknown:
        raise UserError(f"{source}: {field}: yarn field(s) {unknown} are not supported")
    if rs.get("truncate", True) is not True:
        raise UserError(f"{source}: {field}: yarn truncate=false is not supported (megatron rounds the range)")
    if rs.get("mscale_all_dim") and not rs.get("mscale"):
        raise UserError(f"{source}: {field}: yarn mscale_all_dim without mscale is not supported")


def mla_parameters(facts: Any) -> int:
    """Attention parameters of one MLA layer (memory estimate)."""
    m, h, n = facts.mla, facts.hidden_size, facts.num_attention_heads
    qd = m.qk_nope_head_dim + m.qk_rope_head_dim
    q = h * n * qd if m.q_lora_rank is None else h * m.q_lora_rank + m.q_lora_rank * (1 + n * qd)
    kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * (1 + n * (m.qk_nope_head_dim + m.v_head_dim))
    return q + kv + n * m.v_head_dim * h


def config_kwargs(facts: Any) -> dict[str, Any]:
    """MLATransformerConfig fields for a DeepSeek model (on top of build.transformer_config's)."""
    m = facts.mla
    kwargs: dict[str, Any] = dict(
        multi_latent_attention=True,
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_head_dim=m.qk_nope_head_dim,
        qk_pos_emb_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        qk_layernorm=True,  # MLA's q_a / kv_a RMSNorms
        rotary_base=facts.rope_theta,
        rope_type="rope",
        rotary_scaling_factor=1.0,
        mscale=1.0,
        mscale_all_dim=0.0,
        # megatron's fused MLA RoPE is YaRN-only and Triton; the unfused path is exact everywhere
        apply_rope_fusion=False,
    )
    rs = facts.rope_scaling
    if rs:
        factor = rs.get("factor") or facts.max_position_embeddings / rs["original_max_position_embeddings"]
        mscale_all_dim = float(rs.get("mscale_all_dim") or 0.0)
        kwargs.update(
            rope_type="yarn",
            rotary_scaling_factor=float(factor),
            original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
            beta_fast=float(rs.get("beta_fast") or 32),
            beta_slow=float(rs.get("beta_slow") or 1),
            # HF's cos/sin factor is mscale(f, mscale) / mscale(f, mscale_all_dim) when both are set,
            # else mscale(f, 1); megatron's is mscale(f, mscale) / mscale(f, mscale_all_dim)
            mscale=float(rs.get("mscale") or 1.0) if mscale_all_dim else 1.0,
            mscale_all_dim=mscale_all_dim,
        )
    if facts.is_moe:
        layers = facts.num_layers
        kwargs.update(
            moe_layer_freq=[0] * facts.moe_dense_layers + [1] * (layers - facts.moe_dense_layers),
            moe_shared_expert_intermediate_size=facts.moe_shared_ffn_hidden_size,
            moe_router_score_function=facts.moe_score_function,
            moe_router_pre_softmax=facts.moe_score_function == "softmax",
            moe_router_topk_scaling_factor=facts.moe_scaling_factor,
            moe_router_num_groups=facts.moe_num_groups,
            moe_router_group_topk=facts.moe_group_topk,
            moe_router_enable_expert_bias=facts.moe_expert_bias,
            moe_router_bias_update_rate=0.0,
        )
    return kwargs


def is_moe_layer(facts: Any, layer: int) -> bool:
    """Whether global layer `layer` (0-based) has the MoE MLP."""
    return facts.is_moe and layer >= facts.moe_dense_layers

