"""Qwen3 dense: no q/k/v bias, RMSNorm on q and k per head."""

from trinity.convert.families.common import attention_rules, dense_mlp_rules, embedding_rules, norm_rules
from trinity.convert.weightmap import WeightMap

WEIGHT_MAP = WeightMap(
    "qwen3",
    tuple(embedding_rules() + norm_rules() + attention_rules(bias=False, qk_norm=True) + dense_mlp_rules()),
)
