"""Gemma 3 (text): Gemma 2's layout (sandwich norms, (1 + w) RMSNorms copied as they are, tied
embeddings) plus per-head q/k norms, which are (1 + w) RMSNorms too."""

from trinity.convert.families.common import attention_rules, dense_mlp_rules, embedding_rules, sandwich_norm_rules
from trinity.convert.weightmap import WeightMap

WEIGHT_MAP = WeightMap(
    "gemma3",
    tuple(embedding_rules() + sandwich_norm_rules() + attention_rules(bias=True, qk_norm=True) + dense_mlp_rules()),
)
