"""Qwen2-MoE / Qwen1.5-MoE: Qwen2 attention (q/k/v bias), every layer routed experts plus one shared
expert whose output is scaled by sigmoid(shared_expert_gate . x) (megatron-core's SharedExpertMLP with
moe_shared_expert_gate)."""

from trinity.convert.families.common import attention_rules, embedding_rules, moe_rules, norm_rules
from trinity.convert.weightmap import Kind, Rule, WeightMap

_M = "model.layers.{L}.mlp"
_S = "decoder.layers.{L}.mlp.shared_experts"
WEIGHT_MAP = WeightMap(
    "qwen2_moe",
    tuple(
        embedding_rules()
        + norm_rules()
        + attention_rules(bias=True, qk_norm=False)
        + moe_rules(
            router=f"{_M}.gate.weight",
            gate=f"{_M}.experts.{{E}}.gate_proj.weight",
            up=f"{_M}.experts.{{E}}.up_proj.weight",
            down=f"{_M}.experts.{{E}}.down_proj.weight",
        )
        + [
            Rule(f"{_S}.linear_fc1.weight", (f"{_M}.shared_expert.gate_proj.weight", f"{_M}.shared_expert.up_proj.weight"),
                 Kind.GATE_UP, tp_dim=0),
            Rule(f"{_S}.linear_fc2.weight", (f"{_M}.shared_expert.down_proj.weight",), tp_dim=1),
            Rule(f"{_S}.gate_weight", (f"{_M}.shared_expert_gate.weight",)),
        ]
    ),
)
