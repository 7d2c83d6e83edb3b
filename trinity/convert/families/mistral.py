"""Mistral: Llama's layout (no biases); its sliding window is a model fact, not a weight."""

from trinity.convert.families.common import attention_rules, dense_mlp_rules, embedding_rules, norm_rules
from trinity.convert.weightmap import WeightMap

WEIGHT_MAP = WeightMap(
    "mistral",
    tuple(embedding_rules() + norm_rules() + attention_rules(bias=False, qk_norm=False) + dense_mlp_rules()),
)
