"""transformer_config: HF facts + the megatron block -> megatron-core TransformerConfig."""

from __future__ import annotations

import types

import pytest
import torch

from trinity.config.megatron import MegatronConfig
from trinity.errors import UserError
from trinity.models.facts import ModelFacts

from tests.conftest import HF_CONFIGS


def _namespace(**kw):
    """The duck-typed megatron block (what tools pass without the pydantic class)."""
    override = types.SimpleNamespace(
        recompute_granularity=None, recompute_method=None, recompute_num_layers=None, recompute_modules=None,
        extra_fields=lambda: kw.pop("extra", {}),
    )
    base = dict(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
        context_parallel_size=1, expert_model_parallel_size=1, expert_tensor_parallel_size=None,
        sequence_parallel=False, moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
        moe_layer_recompute=False, override_transformer_config=override,
    )
    for key in ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules"):
        if key in kw:
            setattr(override, key, kw.pop(key))
    base.update({k: v for k, v in kw.items() if k != "extra"})
    return types.SimpleNamespace(**base)


def test_qwen2_dense_fields_on_cpu():
    from trinity.models.build import transformer_config

    facts = ModelFacts.from_hf_dir(HF_CONFIGS / "qwen2_5_7b")
    cfg = transformer_config(facts, _namespace(), device="cpu", dtype=torch.float32)
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size) == (28, 3584, 18944)
    assert (cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels) == (28, 4, 128)
    assert cfg.normalization == "RMSNorm" and cfg.gated_linear_unit and cfg.activation_func is torch.nn.functional.silu
    assert cfg.add_qkv_bias and not cfg.add_bias_linear and not cfg.qk_layernorm
    assert cfg.params_dtype == torch.float32 and not cfg.bf16 and cfg.use_cpu_initialization
    fusions = ("masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion",
               "gradient_accumulation_fusion", "persist_layer_norm")
    assert not any(getattr(cfg, f) for f in fusions)
    assert cfg.num_moe_experts is None


def test_qwen3_moe_routing_follows_norm_topk_prob():
    from trinity.models.build import transformer_config

    raw = ModelFacts.from_hf_dir(HF_CONFIGS / "qwen3_30b_a3b")
    cfg = transformer_config(raw, _namespace(), device="cpu", dtype=torch.float32)
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == (128, 8, 768)
    assert cfg.qk_layernorm and not cfg.add_qkv_bias
    # norm_topk_prob=True: softmax over the top-k logits (renormalised), not top-k of a full softmax
    assert raw.moe_norm_topk_prob and cfg.moe_router_pre_softmax is False
    assert cfg.moe_router_load_balancing_type == "none" and cfg.moe_aux_loss_coeff == 0.0
    from dataclasses import replace

    unnormalised = replace(raw, moe_norm_topk_prob=False)
    assert transformer_config(unnormalised, _namespace(), device="cpu", dtype=torch.float32).moe_router_pre_softmax


def test_real_megatron_config_class_with_recompute_enums_and_extra_fields():
    from trinity.models.build import transformer_config

    facts = ModelFacts.from_hf_dir(HF_CONFIGS / "qwen2_5_0_5b")
    block = MegatronConfig.model_validate({
        "tensor_model_parallel_size": 2, "sequence_parallel": True,
        "override_transformer_config": {"recompute_granularity": "selective",
                                        "recompute_modules": ["core_attn", "mlp"], "init_method_std": 0.01},
    })
    cfg = transformer_config(facts, block, device="cpu", dtype=torch.float32)
    assert cfg.recompute_granularity == "selective" and type(cfg.recompute_granularity) is str
    assert cfg.recompute_modules == ["core_attn", "mlp"]
    assert cfg.init_method_std == 0.01
    assert cfg.tensor_model_parallel_size == 2 and cfg.sequence_parallel and cfg.expert_tensor_parallel_size == 2


def test_full_recompute_defaults_to_uniform_one_layer():
    from trinity.models.build import transformer_config

    facts = ModelFacts.from_hf_dir(HF_CONFIGS / "qwen2_5_0_5b")
    cfg = transformer_config(facts, _namespace(recompute_granularity="full"), device="cpu", dtype=torch.float32)
    assert (cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers) == ("full", "uniform", 1)


def test_unknown_override_field_names_the_key():
    from trinity.models.build import transformer_config

    facts = ModelFacts.from_hf_dir(HF_CONFIGS / "qwen2_5_0_5b")
    with pytest.raises(UserError, match="not_a_field"):
        transformer_config(facts, _namespace(extra={"not_a_field": 1}), device="cpu", dtype=torch.float32)


def test_bf16_on_cpu_is_refused_and_cuda_gets_jit_and_rope_fusions():
    from trinity.models.build import transformer_config

    facts = ModelFacts.from_hf_dir(HF_CONFIGS / "qwen2_5_0_5b")
    with pytest.raises(UserError, match="float32"):
        transformer_config(facts, _namespace(), device="cpu", dtype=torch.bfloat16)
    cfg = transformer_config(facts, _namespace(), device="cuda", dtype=torch.bfloat16)
    assert cfg.bf16 and cfg.params_dtype == torch.bfloat16 and not cfg.use_cpu_initialization
    assert cfg.bias_activation_fusion and not cfg.masked_softmax_fusion and cfg.apply_rope_fusion
    from megatron.core.models.common.embeddings import rope_utils

    from trinity.models.rope import fused_rope

    assert rope_utils.fused_apply_rotary_pos_emb is fused_rope  # no TransformerEngine on this machine
    for scope in ("layers", "model"):  # compiled layers: inductor fuses megatron's unfused RoPE itself
        compiled = transformer_config(facts, _namespace(torch_compile=scope), device="cuda", dtype=torch.bfloat16)
        assert not compiled.apply_rope_fusion
    off = transformer_config(facts, _namespace(extra={"apply_rope_fusion": False}), device="cuda", dtype=torch.bfloat16)
    assert not off.apply_rope_fusion  # docs/performance.md: a role can turn it off


def test_padded_vocab_size():
    from trinity.models.build import padded_vocab_size

    facts = ModelFacts.from_hf_dir(HF_CONFIGS / "qwen2_5_0_5b")
    assert facts.vocab_size == 151936
    assert padded_vocab_size(facts, 1) == 151936  # already a multiple of 128
    assert padded_vocab_size(facts, 8) == 152576  # next multiple of 1024


def test_compile_scope_reads_the_optional_block_field():
    from types import SimpleNamespace

    from trinity.errors import UserError
    from trinity.models.build import compile_scope

    assert compile_scope(SimpleNamespace()) == "none"
    assert compile_scope(SimpleNamespace(torch_compile=True)) == "layers"
    assert compile_scope(SimpleNamespace(torch_compile="model")) == "model"
    with pytest.raises(UserError, match="torch_compile"):
        compile_scope(SimpleNamespace(torch_compile="everything"))


def _raw(arch: str, **kw):
    return {"architectures": [arch], "num_hidden_layers": 2, "hidden_size": 3072, "num_attention_heads": 24,
            "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 200064, **kw}


def test_sliding_window_and_partial_rotary_reach_megatron():
    from trinity.models.build import transformer_config

    mistral = ModelFacts.from_hf_dict(_raw("MistralForCausalLM", sliding_window=4096))
    cfg = transformer_config(mistral, _namespace(), device="cpu", dtype=torch.float32)
    assert mistral.sliding_window == 4096 and cfg.window_size == (4095, 0)  # HF's window counts the query
    assert ModelFacts.from_hf_dict(_raw("MistralForCausalLM", sliding_window=None)).sliding_window is None
    # Phi-4-mini: partial_rotary_factor inside rope_parameters (transformers 5) or at the top level
    for where in ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.75}},
                  {"partial_rotary_factor": 0.75}):
        phi = ModelFacts.from_hf_dict(_raw("Phi3ForCausalLM", sliding_window=262143, **where))
        assert phi.rotary_percent == 0.75 and phi.family == "phi3"
        cfg = transformer_config(phi, _namespace(), device="cpu", dtype=torch.float32)
        assert cfg.window_size == (262142, 0) and not cfg.rotary_interleaved


@pytest.mark.parametrize("arch,extra,field", [
    ("Phi3ForCausalLM", {"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}},
     "rope_scaling: type 'longrope'"),
    ("Phi3ForCausalLM", {"rope_scaling": {"type": "su", "short_factor": [1.0], "long_factor": [2.0]}},
     "rope_scaling: type 'su'"),
    ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 4096}, "sliding_window 4096"),
    ("LlamaForCausalLM", {"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ("MistralForCausalLM", {"sliding_window": -1}, "sliding_window -1"),
])
def test_unsupported_family_features_are_refused_naming_the_field(arch, extra, field):
    with pytest.raises(UserError, match=field):
        ModelFacts.from_hf_dict(_raw(arch, **extra))


def test_mbridge_is_refused_for_families_it_has_no_bridge_for(tmp_path):
    import json

    from trinity.convert.api import hf_to_mcore

    (tmp_path / "config.json").write_text(json.dumps(_raw("MistralForCausalLM")))  # refused before the weights
    with pytest.raises(UserError, match="--backend mbridge: mbridge 0.15.1 has no bridge for MistralForCausalLM"):
        hf_to_mcore(str(tmp_path), str(tmp_path / "out"), backend="mbridge", dtype="fp32", device="cpu")


def test_keys_a_config_leaves_out_take_transformers_defaults_of_the_family():
    glm = ModelFacts.from_hf_dict(_raw("Glm4ForCausalLM", head_dim=128))
    assert glm.rotary_percent == 0.5 and glm.rotary_interleaved and glm.post_block_norms  # Glm4Config's 0.5
    moe = dict(num_experts=60, moe_intermediate_size=1408, num_experts_per_tok=4, shared_expert_intermediate_size=5632)
    qwen2_moe = ModelFacts.from_hf_dict(_raw("Qwen2MoeForCausalLM", **moe))
    assert not qwen2_moe.moe_norm_topk_prob and qwen2_moe.moe_shared_ffn_hidden_size == 5632 and qwen2_moe.moe_shared_expert_gate
    assert ModelFacts.from_hf_dict(_raw("Qwen2MoeForCausalLM", norm_topk_prob=True, **moe)).moe_norm_topk_prob
    mixtral = ModelFacts.from_hf_dict(_raw("MixtralForCausalLM", num_local_experts=8, num_experts_per_tok=2))
    assert mixtral.moe_norm_topk_prob
