"""LoRA's target names and sizes without torch (config validation and `trinity validate` stay light);
`trinity.models.lora` re-exports them beside the adapters themselves."""

from __future__ import annotations

from typing import Any, Iterable

# megatron-core module names LoRA can target, and how each is split over TP.
COLUMN_PARALLEL = ("linear_qkv", "linear_fc1")
ROW_PARALLEL = ("linear_proj", "linear_fc2")
MCORE_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# Hugging Face (PEFT) module names -> the megatron-core module that holds them (q, k and v are one
# fused linear_qkv; gate and up are one linear_fc1: an adapter on either covers both).
HF_TO_MCORE: dict[str, str] = {
    "q_proj": "linear_qkv",
    "k_proj": "linear_qkv",
    "v_proj": "linear_qkv",
    "qkv_proj": "linear_qkv",
    "o_proj": "linear_proj",
    "gate_proj": "linear_fc1",
    "up_proj": "linear_fc1",
    "gate_up_proj": "linear_fc1",
    "down_proj": "linear_fc2",
}
ALL_LINEAR = "all-linear"


def resolve_targets(names: Iterable[str]) -> list[str]:
    """megatron-core target names (in MCORE_TARGETS order) for config names that may be HF names or
    `all-linear`; ValueError naming the unknown ones and the valid choices."""
    out: set[str] = set()
    unknown = []
    for name in names:
        if name == ALL_LINEAR:
            out.update(MCORE_TARGETS)
        elif name in MCORE_TARGETS:
            out.add(name)
        elif name in HF_TO_MCORE:
            out.add(HF_TO_MCORE[name])
        else:
            unknown.append(name)
    if unknown:
        valid = [*MCORE_TARGETS, *HF_TO_MCORE, ALL_LINEAR]
        raise ValueError(f"unknown target module(s) {unknown}; valid: {', '.join(valid)}")
    return [t for t in MCORE_TARGETS if t in out]


def linear_shape(facts: Any, target: str) -> tuple[int, int]:
    """(in, out) of one layer's full (TP=1) megatron linear `target` of a dense model."""
    h, hd = facts.hidden_size, facts.head_dim
    q, kv = facts.num_attention_heads * hd, facts.num_query_groups * hd
    gated = getattr(facts, "hidden_act", "silu") in ("silu", "gelu_gated", "swiglu")
    return {
        "linear_qkv": (h, q + 2 * kv),
        "linear_proj": (q, h),
        "linear_fc1": (h, facts.ffn_hidden_size * (2 if gated else 1)),
        "linear_fc2": (facts.ffn_hidden_size, h),
    }[target]


def adapter_parameter_count(facts: Any, rank: int, targets: Iterable[str], *, layers: int | None = None) -> int:
    """Adapter parameters of `layers` decoder layers (all by default), full size (TP=1): r x (in + out)
    per adapted linear."""
    per_layer = sum(rank * sum(linear_shape(facts, t)) for t in resolve_targets(targets))
    return per_layer * (facts.num_layers if layers is None else layers)


def adapter_parameters_per_gpu(facts: Any, rank: int, targets: Iterable[str], *, tp: int, layers: int) -> int:
    """Adapter parameters on one GPU holding `layers` layers at tensor parallel size `tp`: the sharded
    factor (B of a column-parallel base, A of a row-parallel one) is split, the other replicated."""
    total = 0
    for t in resolve_targets(targets):
        n_in, n_out = linear_shape(facts, t)
        total += rank * (n_in + n_out // tp) if t in COLUMN_PARALLEL else rank * (n_in // tp + n_out)
    return total * layers


__all__ = [
    "ALL_LINEAR", "COLUMN_PARALLEL", "HF_TO_MCORE", "MCORE_TARGETS", "ROW_PARALLEL", "adapter_parameter_count",
    "adapter_parameters_per_gpu", "linear_shape", "resolve_targets",
]
