"""DeepSeek-V2 / V3: multi-latent attention, dense first layers, MoE with shared experts (V3: sigmoid
routing with a score-correction bias). HF names of transformers 5.24 (per-expert tensors on disk).

MLA's rotary rows load unpermuted: megatron's MLA RoPE de-interleaves q_pe/k_pe itself
(trinity.models.deepseek). Our spec splits every MLA projection over TP by output rows (the down
projections too: ColumnParallelLinear, gathered in the layer); linear_proj by input columns.
"""

from trinity.convert.families.common import dense_mlp_rules, embedding_rules, moe_rules, norm_rules
from trinity.convert.weightmap import Kind, Rule, WeightMap

_ATT = "decoder.layers.{L}.self_attention"
_HF = "model.layers.{L}.self_attn"
_MLP = "model.layers.{L}.mlp"


def mla_rules() -> list[Rule]:
    return [
        Rule(f"{_ATT}.linear_q_proj.weight", (f"{_HF}.q_proj.weight",), tp_dim=0),  # q_lora_rank None
        Rule(f"{_ATT}.linear_q_down_proj.weight", (f"{_HF}.q_a_proj.weight",), tp_dim=0),
        Rule(f"{_ATT}.q_layernorm.weight", (f"{_HF}.q_a_layernorm.weight",)),
        Rule(f"{_ATT}.linear_q_up_proj.weight", (f"{_HF}.q_b_proj.weight",), tp_dim=0),
        Rule(f"{_ATT}.linear_kv_down_proj.weight", (f"{_HF}.kv_a_proj_with_mqa.weight",), tp_dim=0),
        Rule(f"{_ATT}.kv_layernorm.weight", (f"{_HF}.kv_a_layernorm.weight",)),
        Rule(f"{_ATT}.linear_kv_up_proj.weight", (f"{_HF}.kv_b_proj.weight",), tp_dim=0),
        Rule(f"{_ATT}.linear_proj.weight", (f"{_HF}.o_proj.weight",), tp_dim=1),
    ]


def shared_expert_rules() -> list[Rule]:
    mc = "decoder.layers.{L}.mlp.shared_experts"
    hf = f"{_MLP}.shared_experts"
    return [
        Rule(f"{mc}.linear_fc1.weight", (f"{hf}.gate_proj.weight", f"{hf}.up_proj.weight"), Kind.GATE_UP, tp_dim=0),
        Rule(f"{mc}.linear_fc2.weight", (f"{hf}.down_proj.weight",), tp_dim=1),
    ]


def _rules(expert_bias: bool) -> tuple[Rule, ...]:
    rules = (
        embedding_rules()
        + norm_rules()
        + mla_rules()
        + dense_mlp_rules()
        + shared_expert_rules()
        + moe_rules(
            router=f"{_MLP}.gate.weight",
            gate=f"{_MLP}.experts.{{E}}.gate_proj.weight",
            up=f"{_MLP}.experts.{{E}}.up_proj.weight",
            down=f"{_MLP}.experts.{{E}}.down_proj.weight",
        )
    )
    if expert_bias:  # megatron's router buffer `expert_bias`
        rules.append(Rule("decoder.layers.{L}.mlp.router.expert_bias", (f"{_MLP}.gate.e_score_correction_bias",)))
    return tuple(rules)


WEIGHT_MAP_V2 = WeightMap("deepseek_v2", _rules(expert_bias=False))
WEIGHT_MAP_V3 = WeightMap("deepseek_v3", _rules(expert_bias=True))
