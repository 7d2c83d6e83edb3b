"""LoRA's target names and sizes without torch (config validation and `trinity validate` stay light);
`trinity.models.lora` re-exports them beside the adapters themselves."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

# megatron-core module names LoRA can target, and how each is split over TP. MLA (DeepSeek) has no
# linear_qkv: its latent projections are the targets there (all column-parallel; V2-Lite's q_proj without a
# q LoRA takes no adapter: HF's `q_proj` names GQA's fused linear_qkv here).
MLA_TARGETS = ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj")
COLUMN_PARALLEL = ("linear_qkv", "linear_fc1", *MLA_TARGETS)
ROW_PARALLEL = ("linear_proj", "linear_fc2")
MCORE_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # what all-linear means
LORA_TARGETS = (*MCORE_TARGETS, *MLA_TARGETS)  # every name a config may give, in resolution order
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
    "q_a_proj": "linear_q_down_proj",
    "q_b_proj": "linear_q_up_proj",
    "kv_a_proj_with_mqa": "linear_kv_down_proj",
    "kv_b_proj": "linear_kv_up_proj",
}
ALL_LINEAR = "all-linear"


def resolve_targets(names: Iterable[str]) -> list[str]:
    """megatron-core target names (in LORA_TARGETS order) for config names that may be HF names or
    `all-linear`; ValueError naming the unknown ones and the valid choices."""
    out: set[str] = set()
    unknown = []
    for name in names:
        if name == ALL_LINEAR:
            out.update(MCORE_TARGETS)
        elif name in LORA_TARGETS:
            out.add(name)
        elif name in HF_TO_MCORE:
            out.add(HF_TO_MCORE[name])
        else:
            unknown.append(name)
    if unknown:
        valid = [*LORA_TARGETS, *HF_TO_MCORE, ALL_LINEAR]
        raise ValueError(f"unknown target module(s) {unknown}; valid: {', '.join(valid)}")
    return [t for t in LORA_TARGETS if t in out]


# A PEFT adapter folder (trinity.convert.peft_io writes and reads it; config validation reads its config)
PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"
# the HF projections one fused megatron linear holds: a folder must adapt all of them or none
_FUSED_PARTS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_fc1": ("gate_proj", "up_proj")}
_FUSED_WHOLE = {"qkv_proj": "linear_qkv", "gate_up_proj": "linear_fc1"}


def read_adapter_config(folder: str | Path) -> dict[str, Any]:
    """adapter_config.json of a PEFT folder that holds plain LoRA adapters (both files present); UserError
    naming the file otherwise."""
    import json

    from trinity.errors import UserError

    folder = Path(folder)
    cfg_path = folder / PEFT_CONFIG_FILE
    for path in (cfg_path, folder / PEFT_WEIGHTS_FILE):
        if not path.is_file():
            raise UserError(f"{path}: missing; a PEFT adapter folder holds {PEFT_CONFIG_FILE} and {PEFT_WEIGHTS_FILE}")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{cfg_path}: not valid JSON ({e})") from None
    unsupported = [
        what for what, bad in (
            (f"peft_type {config.get('peft_type')!r}", config.get("peft_type") != "LORA"),
            ("use_dora", bool(config.get("use_dora"))), ("use_rslora", bool(config.get("use_rslora"))),
            ("fan_in_fan_out", bool(config.get("fan_in_fan_out"))),
            (f"bias {config.get('bias')!r}", config.get("bias", "none") != "none"),
            ("modules_to_save", bool(config.get("modules_to_save"))),
            ("rank_pattern / alpha_pattern", bool(config.get("rank_pattern") or config.get("alpha_pattern"))),
        ) if bad
    ]
    if unsupported:
        raise UserError(f"{cfg_path}: {', '.join(unsupported)}: only plain LoRA adapters (peft_type LORA, one r and "
                        "lora_alpha, no DoRA, rsLoRA, bias or modules_to_save) map onto trinity's adapters")
    return config


def adapter_config_targets(config: dict[str, Any], where: str | Path) -> list[str]:
    """megatron-core targets of a PEFT adapter_config.json's target_modules; UserError naming `where` for
    names trinity cannot hold exactly (unknown ones, a regex, or part of a fused linear: q_proj without
    k_proj and v_proj, gate_proj without up_proj)."""
    from trinity.errors import UserError

    names = config.get("target_modules") or []
    names = [names] if isinstance(names, str) else list(names)
    try:
        targets = resolve_targets(names)
    except ValueError as exc:
        raise UserError(f"{where}: target_modules: {exc}") from None
    given = set(names)
    for linear, parts in _FUSED_PARTS.items():
        whole = ALL_LINEAR in given or linear in given or any(_FUSED_WHOLE.get(n) == linear for n in given)
        missing = [x for x in parts if x not in given]
        if linear in targets and not whole and missing:
            raise UserError(
                f"{where}: target_modules adapts {', '.join(x for x in parts if x in given)} but not "
                f"{', '.join(missing)}; megatron-core fuses {', '.join(parts)} into {linear}, whose one adapter "
                "cannot hold a part of them: only folders adapting all of them (with one shared lora_A) load")
    return targets


def check_shared_a(folder: str | Path) -> None:
    """UserError naming the weights file when the q/k/v (gate/up) adapters of one layer have different
    lora_A: megatron's fused linear holds one A. Reads only the lora_A tensors (r x in each)."""
    from safetensors import safe_open

    from trinity.errors import UserError

    where = Path(folder) / PEFT_WEIGHTS_FILE
    with safe_open(str(where), framework="pt") as f:
        keys = set(f.keys())
        for linear, parts in _FUSED_PARTS.items():
            suffix = f".{parts[0]}.lora_A.weight"
            for key in sorted(k for k in keys if k.endswith(suffix)):
                stem = key[: -len(suffix)]
                first = f.get_tensor(key)
                for part in parts[1:]:
                    other = f"{stem}.{part}.lora_A.weight"
                    if other in keys and not f.get_tensor(other).equal(first):
                        m0 = (stem + "." + parts[0]).removeprefix("base_model.model.")
                        m = (stem + "." + part).removeprefix("base_model.model.")
                        raise UserError(
                            f"{where}: {m} and {m0} have different lora_A; megatron fuses them into one linear "
                            f"({linear}) whose adapter has one A, so only adapters trained by trinity (or with a "
                            "shared A) load")


def linear_shape(facts: Any, target: str) -> tuple[int, int]:
    """(in, out) of one layer's full (TP=1) megatron linear `target` of a dense model; (0, 0) for a target
    the model has not (MLA's latent projections elsewhere, linear_qkv with MLA): no adapter there."""
    h, hd, n = facts.hidden_size, facts.head_dim, facts.num_attention_heads
    q, kv = n * hd, facts.num_query_groups * hd
    gated = getattr(facts, "hidden_act", "silu") in ("silu", "gelu_gated", "swiglu")
    shapes = {
        "linear_qkv": (h, q + 2 * kv),
        "linear_proj": (q, h),
        "linear_fc1": (h, facts.ffn_hidden_size * (2 if gated else 1)),
        "linear_fc2": (facts.ffn_hidden_size, h),
    }
    mla = getattr(facts, "mla", None)
    if mla is not None:
        del shapes["linear_qkv"]
        shapes["linear_proj"] = (n * mla.v_head_dim, h)  # the heads' values, v_head_dim wide
        shapes["linear_kv_down_proj"] = (h, mla.kv_lora_rank + mla.qk_rope_head_dim)
        shapes["linear_kv_up_proj"] = (mla.kv_lora_rank, n * (mla.qk_nope_head_dim + mla.v_head_dim))
        if mla.q_lora_rank is not None:
            shapes["linear_q_down_proj"] = (h, mla.q_lora_rank)
            shapes["linear_q_up_proj"] = (mla.q_lora_rank, hd * n)
    return shapes.get(target, (0, 0))


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
    "ALL_LINEAR", "COLUMN_PARALLEL", "HF_TO_MCORE", "LORA_TARGETS", "MCORE_TARGETS", "MLA_TARGETS", "ROW_PARALLEL", "adapter_parameter_count",
    "PEFT_CONFIG_FILE", "PEFT_WEIGHTS_FILE", "adapter_config_targets", "check_shared_a", "adapter_parameters_per_gpu", "linear_shape",
    "read_adapter_config", "resolve_targets",
]
