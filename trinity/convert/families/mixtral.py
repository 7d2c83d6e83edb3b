"""Mixtral: Llama attention, `block_sparse_moe` with experts w1 (gate), w3 (up), w2 (down)."""

from trinity.convert.families.common import attention_rules, embedding_rules, moe_rules, norm_rules
from trinity.convert.weightmap import WeightMap

_M = "model.layers.{L}.block_sparse_moe"
WEIGHT_MAP = WeightMap(
    "mixtral",
    tuple(
        embedding_rules()
        + norm_rules()
        + attention_rules(bias=False, qk_norm=False)
        + moe_rules(
            router=f"{_M}.gate.weight",
            gate=f"{_M}.experts.{{E}}.w1.weight",
            up=f"{_M}.experts.{{E}}.w3.weight",
            down=f"{_M}.experts.{{E}}.w2.weight",
        )
    ),
)
