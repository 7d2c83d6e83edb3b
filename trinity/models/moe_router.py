"""Group-limited top-k routing as transformers' DeepSeek routers compute it, inside megatron-core's router.

megatron-core's `group_limited_topk` ranks an expert group by the sum of its top (top_k // group_topk)
scores; transformers' DeepSeek-V2 `group_limited_greedy` ranks it by its top score, DeepSeek-V3 by the sum
of its top 2, whatever top_k and topk_group are (the two agree for V3's released config, 8 // 4 = 2, not
for V2's, 6 // 3). `GroupScoreRouter` is megatron's TopKRouter with that group score a parameter
(`group_score_topk`), used by our layer spec for DeepSeek's grouped routing; ungrouped routing is
megatron's own code path. The rest follows megatron's unfused `topk_routing_with_score_function`: softmax
over all experts before top-k, or sigmoid with the expert bias used for choosing only and the chosen
scores renormalised (top_k > 1), then the scaling factor; the expert-bias token counts are megatron's.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.moe.router import TopKRouter


def group_limited_routing(
    logits: torch.Tensor, *, topk: int, num_groups: int, group_topk: int, group_score_topk: int, score: str,
    expert_bias: torch.Tensor | None, scaling: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing probs [tokens, experts], routing map [tokens, experts] bool) of logits [tokens, experts]."""
    n, experts = logits.shape
    if score == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
        choice = scores
    else:
        scores = torch.sigmoid(logits.float()).type_as(logits)
        choice = scores if expert_bias is None else scores + expert_bias
    per_group = choice.view(n, num_groups, experts // num_groups)
    group_scores = per_group.topk(group_score_topk, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    mask = group_mask.unsqueeze(-1).expand(n, num_groups, experts // num_groups).reshape(n, experts)
    top = torch.topk(choice.masked_fill(~mask.bool(), float("-inf")), k=topk, dim=-1)[1]
    probs = scores.gather(1, top)
    if score == "sigmoid" and topk > 1:
        probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling:
        probs = probs * scaling
    routing_probs = torch.zeros_like(logits).scatter(1, top, probs)
    routing_map = torch.zeros_like(logits).int().scatter(1, top, 1).bool()
    return routing_probs, routing_map


class GroupScoreRouter(TopKRouter):
    """megatron's TopKRouter whose group-limited top-k scores a group by the sum of its top
    `group_score_topk` scores (module doc)."""

    def __init__(self, config: Any, pg_collection: Any = None, *, group_score_topk: int) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        self.group_score_topk = group_score_topk
        if config.moe_router_group_topk:
            unsupported = [name for name, on in (
                ("moe_router_load_balancing_type", self.routing_type != "none"),
                ("moe_expert_capacity_factor", config.moe_expert_capacity_factor is not None),
                ("moe_router_fusion", bool(config.moe_router_fusion)),
            ) if on]
            if unsupported:
                from trinity.errors import UserError

                raise UserError(f"override_transformer_config: {', '.join(unsupported)} with DeepSeek's group-limited "
                                "routing is not supported; leave it at its default")

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):  # type: ignore[override]
        config = self.config
        if not config.moe_router_group_topk:
            return super().routing(logits, padding_mask)
        logits = logits.view(-1, config.num_moe_experts)
        if padding_mask is not None:
            padding_mask = padding_mask.reshape(-1)
        logits = self.apply_z_loss(logits, padding_mask=padding_mask)
        probs, routing_map = group_limited_routing(
            logits, topk=self.topk, num_groups=config.moe_router_num_groups, group_topk=config.moe_router_group_topk,
            group_score_topk=self.group_score_topk, score=self.score_function, expert_bias=self.expert_bias,
            scaling=config.moe_router_topk_scaling_factor,
        )
        self._apply_expert_bias(routing_map, padding_mask=padding_mask)
        return probs, routing_map
