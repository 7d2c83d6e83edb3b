"""Qwen2 / Qwen2.5: Llama layout plus q/k/v bias."""

from trinity.convert.families.common import attention_rules, dense_mlp_rules, embedding_rules, norm_rules
from trinity.convert.weightmap import WeightMap

WEIGHT_MAP = WeightMap(
    "qwen2",
    tuple(embedding_rules() + norm_rules() + attention_rules(bias=True, qk_norm=False) + dense_mlp_rules()),
)
