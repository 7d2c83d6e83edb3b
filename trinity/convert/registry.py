"""Family name (`ModelFacts.family`) -> weight map. Adding a family: one module and one row here."""

from __future__ import annotations

from trinity.convert.families import (
    deepseek, gemma2, gemma3, glm4, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe,
)
from trinity.convert.weightmap import WeightMap
from trinity.errors import UserError

WEIGHT_MAPS: dict[str, WeightMap] = {
    m.WEIGHT_MAP.family: m.WEIGHT_MAP
    for m in (llama, qwen2, qwen3, qwen3_moe, mixtral, mistral, phi3, qwen2_moe, glm4, gemma2, gemma3)
}
WEIGHT_MAPS.update({w.family: w for w in (deepseek.WEIGHT_MAP_V2, deepseek.WEIGHT_MAP_V3)})


def weight_map(family: str, source: str = "config.json") -> WeightMap:
    """The weight map of `family`; UserError listing the supported families otherwise."""
    try:
        return WEIGHT_MAPS[family]
    except KeyError:
        raise UserError(
            f"{source}: no weight map for model family {family!r}; supported: {', '.join(sorted(WEIGHT_MAPS))}"
        ) from None
