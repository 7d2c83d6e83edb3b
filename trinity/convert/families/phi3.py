"""Phi-3 / Phi-3.5 / Phi-4-mini: Llama's layer with q, k, v fused in one `qkv_proj` ([q; k; v] rows) and
gate, up in one `gate_up_proj` ([gate; up] rows, megatron's own fc1 layout)."""

from trinity.convert.families.common import embedding_rules, norm_rules
from trinity.convert.weightmap import Kind, Rule, WeightMap

_ATT = "decoder.layers.{L}.self_attention"
_HF = "model.layers.{L}"
WEIGHT_MAP = WeightMap(
    "phi3",
    tuple(
        embedding_rules()
        + norm_rules()
        + [
            Rule(f"{_ATT}.linear_qkv.weight", (f"{_HF}.self_attn.qkv_proj.weight",), Kind.FUSED_QKV, tp_dim=0),
            Rule(f"{_ATT}.linear_proj.weight", (f"{_HF}.self_attn.o_proj.weight",), tp_dim=1),
            Rule("decoder.layers.{L}.mlp.linear_fc1.weight", (f"{_HF}.mlp.gate_up_proj.weight",), Kind.FUSED_GATE_UP,
                 tp_dim=0),
            Rule("decoder.layers.{L}.mlp.linear_fc2.weight", (f"{_HF}.mlp.down_proj.weight",), tp_dim=1),
        ]
    ),
)
