"""Gemma 2: Llama's attention and gated MLP (GELU-tanh), a norm before and after each block
(sandwich), (1 + w) RMSNorms whose HF weights are copied as they are (the layer norm computes 1 + w),
tied embeddings."""

from trinity.convert.families.common import attention_rules, dense_mlp_rules, embedding_rules, sandwich_norm_rules
from trinity.convert.weightmap import WeightMap

WEIGHT_MAP = WeightMap(
    "gemma2",
    tuple(embedding_rules() + sandwich_norm_rules() + attention_rules(bias=True, qk_norm=False) + dense_mlp_rules()),
)
