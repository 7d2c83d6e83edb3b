"""Qwen3-MoE: Qwen3 attention, every layer a routed MoE (no shared expert)."""

from trinity.convert.families.common import attention_rules, embedding_rules, moe_rules, norm_rules
from trinity.convert.weightmap import WeightMap

_E = "model.layers.{L}.mlp.experts.{E}"
WEIGHT_MAP = WeightMap(
    "qwen3_moe",
    tuple(
        embedding_rules()
        + norm_rules()
        + attention_rules(bias=False, qk_norm=True)
        + moe_rules(
            router="model.layers.{L}.mlp.gate.weight",
            gate=f"{_E}.gate_proj.weight",
            up=f"{_E}.up_proj.weight",
            down=f"{_E}.down_proj.weight",
        )
    ),
)
