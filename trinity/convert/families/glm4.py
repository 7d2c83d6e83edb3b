"""GLM-4 (Glm4ForCausalLM): q/k/v bias (`attention_bias`), fused `gate_up_proj` ([gate; up] rows), and
an RMSNorm on each block's output before its residual add (`post_self_attn_layernorm`,
`post_mlp_layernorm`: our spec's `post_layernorm` of the attention and MLP modules). Its RoPE (half of
each head, adjacent pairs) is a model fact, not a weight."""

from trinity.convert.families.common import attention_rules, embedding_rules, norm_rules
from trinity.convert.weightmap import Kind, Rule, WeightMap

_HF = "model.layers.{L}"
WEIGHT_MAP = WeightMap(
    "glm4",
    tuple(
        embedding_rules()
        + norm_rules()
        + attention_rules(bias=True, qk_norm=False)
        + [
            Rule("decoder.layers.{L}.self_attention.post_layernorm.weight", (f"{_HF}.post_self_attn_layernorm.weight",)),
            Rule("decoder.layers.{L}.mlp.linear_fc1.weight", (f"{_HF}.mlp.gate_up_proj.weight",), Kind.FUSED_GATE_UP,
                 tp_dim=0),
            Rule("decoder.layers.{L}.mlp.linear_fc2.weight", (f"{_HF}.mlp.down_proj.weight",), tp_dim=1),
            Rule("decoder.layers.{L}.mlp.post_layernorm.weight", (f"{_HF}.post_mlp_layernorm.weight",)),
        ]
    ),
)
