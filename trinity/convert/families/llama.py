"""Llama: GQA attention (q/k/v bias only when `attention_bias`), swiglu MLP."""

from trinity.convert.families.common import attention_rules, dense_mlp_rules, embedding_rules, norm_rules
from trinity.convert.weightmap import WeightMap

# Llama's attention_bias is rare but legal; the bias rules only fire when the model has the params.
WEIGHT_MAP = WeightMap(
    "llama",
    tuple(embedding_rules() + norm_rules() + attention_rules(bias=True, qk_norm=False) + dense_mlp_rules()),
)
