"""Rule groups shared by the decoder-only families (GPTModel names on the left, HF on the right).

Both spellings of the layer norms are declared: TransformerEngine fuses them into the following linear
(`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`), our local spec keeps them separate
(`input_layernorm.weight`, `pre_mlp_layernorm.weight`). A model has one spelling or the other.
"""

from __future__ import annotations

from trinity.convert.weightmap import Kind, Rule

_ATT = "decoder.layers.{L}.self_attention"
_HF_ATT = "model.layers.{L}.self_attn"


def embedding_rules() -> list[Rule]:
    return [
        Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), Kind.VOCAB, tp_dim=0),
        Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
        Rule("output_layer.weight", ("lm_head.weight",), Kind.VOCAB, tp_dim=0, untied_only=True),
        # With tied embeddings the last pipeline stage still holds its own output_layer copy.
        Rule("output_layer.weight", ("model.embed_tokens.weight",), Kind.VOCAB, tp_dim=0, tied_only=True),
    ]


def norm_rules() -> list[Rule]:
    inp = ("model.layers.{L}.input_layernorm.weight",)
    post = ("model.layers.{L}.post_attention_layernorm.weight",)
    return [
        Rule(f"{_ATT}.linear_qkv.layer_norm_weight", inp),
        Rule("decoder.layers.{L}.input_layernorm.weight", inp),
        Rule("decoder.layers.{L}.mlp.linear_fc1.layer_norm_weight", post),
        Rule("decoder.layers.{L}.pre_mlp_layernorm.weight", post),
    ]


def sandwich_norm_rules() -> list[Rule]:
    """Gemma's four norms per layer: HF's post_attention_layernorm follows attention (before the
    residual add), pre_feedforward_layernorm is megatron's pre_mlp_layernorm."""
    hf = "model.layers.{L}"
    return [
        Rule("decoder.layers.{L}.input_layernorm.weight", (f"{hf}.input_layernorm.weight",)),
        Rule("decoder.layers.{L}.post_self_attn_layernorm.weight", (f"{hf}.post_attention_layernorm.weight",)),
        Rule("decoder.layers.{L}.pre_mlp_layernorm.weight", (f"{hf}.pre_feedforward_layernorm.weight",)),
        Rule("decoder.layers.{L}.post_mlp_layernorm.weight", (f"{hf}.post_feedforward_layernorm.weight",)),
    ]


def attention_rules(*, bias: bool, qk_norm: bool) -> list[Rule]:
    qkv = tuple(f"{_HF_ATT}.{p}_proj.weight" for p in "qkv")
    rules = [
        Rule(f"{_ATT}.linear_qkv.weight", qkv, Kind.QKV, tp_dim=0),
        Rule(f"{_ATT}.linear_proj.weight", (f"{_HF_ATT}.o_proj.weight",), tp_dim=1),
    ]
    if bias:
        qkv_b = tuple(f"{_HF_ATT}.{p}_proj.bias" for p in "qkv")
        rules.append(Rule(f"{_ATT}.linear_qkv.bias", qkv_b, Kind.QKV, tp_dim=0))
    if qk_norm:
        rules += [
            Rule(f"{_ATT}.q_layernorm.weight", (f"{_HF_ATT}.q_norm.weight",)),
            Rule(f"{_ATT}.k_layernorm.weight", (f"{_HF_ATT}.k_norm.weight",)),
        ]
    return rules


def dense_mlp_rules() -> list[Rule]:
    hf = "model.layers.{L}.mlp"
    return [
        Rule(
            "decoder.layers.{L}.mlp.linear_fc1.weight",
            (f"{hf}.gate_proj.weight", f"{hf}.up_proj.weight"),
            Kind.GATE_UP,
            tp_dim=0,
        ),
        Rule("decoder.layers.{L}.mlp.linear_fc2.weight", (f"{hf}.down_proj.weight",), tp_dim=1),
    ]


def moe_rules(*, router: str, gate: str, up: str, down: str) -> list[Rule]:
    """Router plus experts in all three megatron-core spellings: SequentialMLP (`local_experts.E`),
    TEGroupedMLP (`linear_fc1.weightE`) and the legacy GroupedMLP (`weight1` / `weight2`)."""
    mlp = "decoder.layers.{L}.mlp"
    return [
        Rule(f"{mlp}.router.weight", (router,)),
        Rule(f"{mlp}.experts.local_experts.{{E}}.linear_fc1.weight", (gate, up), Kind.GATE_UP, tp_dim=0),
        Rule(f"{mlp}.experts.local_experts.{{E}}.linear_fc2.weight", (down,), tp_dim=1),
        Rule(f"{mlp}.experts.linear_fc1.weight{{E}}", (gate, up), Kind.GATE_UP, tp_dim=0),
        Rule(f"{mlp}.experts.linear_fc2.weight{{E}}", (down,), tp_dim=1),
        Rule(f"{mlp}.experts.weight1", (gate, up), Kind.GROUPED_FC1, tp_dim=1),
        Rule(f"{mlp}.experts.weight2", (down,), Kind.GROUPED_FC2, tp_dim=0),
    ]
