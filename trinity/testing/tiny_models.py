"""Tiny random-weight HF checkpoints of each supported family, for tests, benchmarks and the quickstart.

No model hub is reachable, so every test that needs "a Qwen2" makes one here: 2 layers, hidden 64,
4 heads, 2 KV heads, vocab 128 (MoE: 4 experts, top-2), saved with `save_pretrained` as safetensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Shape shared by every family; one place to change it.
_BASE: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.02,
)
_MOE: dict[str, Any] = dict(num_experts_per_tok=2, moe_intermediate_size=32)


@dataclass(frozen=True)
class TinyFamily:
    config_class: str  # transformers class names, imported lazily
    model_class: str
    defaults: dict[str, Any] = field(default_factory=dict)


FAMILIES: dict[str, TinyFamily] = {
    "llama": TinyFamily("LlamaConfig", "LlamaForCausalLM", {"attention_bias": False}),
    "qwen2": TinyFamily("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": False}),
    "qwen3": TinyFamily("Qwen3Config", "Qwen3ForCausalLM", {"attention_bias": False, "use_sliding_window": False}),
    "qwen3_moe": TinyFamily(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {**_MOE, "num_experts": 4, "num_local_experts": 4, "norm_topk_prob": True, "decoder_sparse_step": 1,
         "mlp_only_layers": [], "attention_bias": False, "use_sliding_window": False},
    ),
    "mixtral": TinyFamily(
        "MixtralConfig", "MixtralForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    ),
    # DeepSeek: MLA (V2-Lite's q_proj without a q LoRA; V3's q_a/q_b), layer 0 dense then MoE layers with
    # a shared expert; V2 softmax greedy top-2, V3 sigmoid + score bias with group-limited routing.
    "deepseek_v2": TinyFamily(
        "DeepseekV2Config", "DeepseekV2ForCausalLM",
        {**_MOE, "num_key_value_heads": 4, "n_routed_experts": 4, "n_shared_experts": 1, "first_k_dense_replace": 1,
         "q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
         "topk_method": "greedy", "routed_scaling_factor": 1.5, "head_dim": 8},
    ),
    "deepseek_v3": TinyFamily(
        "DeepseekV3Config", "DeepseekV3ForCausalLM",
        {**_MOE, "num_key_value_heads": 4, "n_routed_experts": 8, "n_shared_experts": 1, "first_k_dense_replace": 1,
         "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
         "n_group": 2, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "head_dim": 8},
    ),
    # every feature on at tiny scale: a window shorter than the test prompts + responses, soft caps
    # that bite (scores and logits of a few units), a query_pre_attn_scalar unlike head_dim
    "gemma2": TinyFamily(
        "Gemma2Config", "Gemma2ForCausalLM",
        {"sliding_window": 4, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0,
         "query_pre_attn_scalar": 24, "num_hidden_layers": 3, "attention_bias": False,
         "initializer_range": 0.1},
    ),
    # 6 layers of the 5:1 local:global pattern (transformers' default layer_types), q/k norms, the local
    # RoPE base unlike the global one, linear RoPE scaling on the global layers, a window of 4; Gemma 3
    # has no soft caps by default
    "gemma3": TinyFamily(
        "Gemma3TextConfig", "Gemma3ForCausalLM",
        {"sliding_window": 4, "query_pre_attn_scalar": 24, "num_hidden_layers": 6, "attention_bias": False,
         "initializer_range": 0.1,
         "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}},
    ),
    # Qwen1.5-MoE's routing (norm_topk_prob False: top-k of the full softmax) and its gated shared expert
    "qwen2_moe": TinyFamily(
        "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
        {**_MOE, "num_experts": 4, "norm_topk_prob": False, "shared_expert_intermediate_size": 48,
         "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False},
    ),
    # GLM-4's half-head interleaved RoPE, q/k/v bias, fused gate_up_proj and post-block norms
    "glm4": TinyFamily("Glm4Config", "Glm4ForCausalLM", {"partial_rotary_factor": 0.5, "attention_bias": True,
                                                         "pad_token_id": 0, "eos_token_id": 2, "bos_token_id": 1}),
    # a window shorter than the tests' sequences, so that a decoder or mask ignoring it changes tokens
    "mistral": TinyFamily("MistralConfig", "MistralForCausalLM", {"sliding_window": 4}),
    # Phi-4-mini's partial rotary (0.75 of each head) and a window, fused qkv_proj / gate_up_proj
    "phi3": TinyFamily("Phi3Config", "Phi3ForCausalLM", {"partial_rotary_factor": 0.75, "sliding_window": 5, "pad_token_id": 0, "bos_token_id": 1,
                                                         "eos_token_id": 2}),
}


def tiny_hf_config(family: str, **config_overrides: Any) -> Any:
    """The transformers config of a tiny `family` model (the shared shape, the family's features switched
    on, then `config_overrides`)."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown tiny family {family!r}; one of {sorted(FAMILIES)}")
    spec = FAMILIES[family]
    kwargs = {**_BASE, **spec.defaults, **config_overrides}
    if "moe_intermediate_size" in kwargs and family == "mixtral":
        kwargs.pop("moe_intermediate_size", None)  # Mixtral experts use intermediate_size
    return getattr(transformers, spec.config_class)(**kwargs)


def tiny_hf_model(config: Any, *, seed: int = 0) -> Any:
    """A random-weight fp32 model of `config` (a tiny_hf_config)."""
    import torch
    import transformers

    spec = next(f for f in FAMILIES.values() if f.config_class == type(config).__name__)
    torch.manual_seed(seed)
    return getattr(transformers, spec.model_class)(config).to(torch.float32)


def make_tiny_hf_model(
    family: str, out_dir: str | Path, *, seed: int = 0, tie_word_embeddings: bool = False, **config_overrides: Any
) -> Path:
    """Write a random-weight HF causal LM of `family` to `out_dir` and return that path."""
    import torch

    config = tiny_hf_config(family, tie_word_embeddings=tie_word_embeddings, **config_overrides)
    model = tiny_hf_model(config, seed=seed)
    # Random init gives near-zero norms' deviation from 1; perturb every parameter so that a wrong
    # weight mapping (e.g. swapped norms) changes the logits.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        for name, buf in model.named_buffers():  # DeepSeek-V3's router score bias: make it matter
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.1)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    return out


def tiny_chunk_cpu(family: str, root: Path, **config_overrides: Any) -> tuple[Any, Any, Path]:
    """(model chunk, ModelFacts, HF folder) of the tiny random model of `family` made under `root`
    (`config_overrides`: as `make_tiny_hf_model`'s), fp32 on the CPU at TP=PP=1, with megatron's parallel
    state brought up (gloo, one process) for it; the caller tears it down
    (`trinity.distributed.parallel.destroy`) when done. What the rollout and workflow tests and the CPU
    schedule benchmark decode with."""
    import torch

    from trinity.config.megatron import MegatronConfig
    from trinity.convert.builtin import load_hf_weights
    from trinity.distributed.layout import ParallelLayout
    from trinity.distributed.parallel import init_parallel
    from trinity.models.build import build_model
    from trinity.models.facts import ModelFacts

    path = make_tiny_hf_model(family, root, **config_overrides)
    facts = ModelFacts.from_hf_dir(path)
    init_parallel(device="cpu", layout=ParallelLayout(), seed=3)
    chunks = build_model(facts, MegatronConfig(), device="cpu", dtype=torch.float32)
    load_hf_weights(chunks, path, facts)
    return chunks[0], facts, path
