"""The `megatron:` block of a role (actor, ref, critic).

Field names are megatron-core's / Trinity-RFT's / verl's on purpose: users paste their existing
`actor_rollout_ref.actor.megatron` sections unchanged. Recompute and offload are typed here so that
the rest of the code branches on validated values, never on raw strings.
"""

from __future__ import annotations

import enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from trinity.distributed.layout import ParallelLayout


class StrictModel(BaseModel):
    """Base of every config section: unknown keys are errors (with a did-you-mean in the loader), and so
    are inf and nan in every float field: YAML reads `.inf` / `.nan` as numbers, and an infinite lr (or
    any other non-finite setting) would train NaN weights, save and export them, and exit 0."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True,
                              allow_inf_nan=False)


class RecomputeGranularity(str, enum.Enum):
    full = "full"
    selective = "selective"


class RecomputeMethod(str, enum.Enum):
    uniform = "uniform"
    block = "block"


class RecomputeModule(str, enum.Enum):
    """Sub-modules megatron-core 0.16.1 can recompute under selective granularity."""

    core_attn = "core_attn"
    moe_act = "moe_act"
    layernorm = "layernorm"
    mla_up_proj = "mla_up_proj"
    mlp = "mlp"
    moe = "moe"
    shared_experts = "shared_experts"


class OverrideTransformerConfig(BaseModel):
    """TransformerConfig overrides: typed recompute fields plus an open map of other fields.

    Keys other than the recompute ones are passed to megatron-core's TransformerConfig as they are;
    their names are checked against that dataclass's fields (read from megatron-core's source, so
    validation does not import it).
    """

    model_config = ConfigDict(extra="allow", validate_assignment=True, use_attribute_docstrings=True,
                              allow_inf_nan=False)

    recompute_granularity: RecomputeGranularity | None = None
    """Activation recompute: `full` (whole layers) or `selective` (the modules in recompute_modules)."""
    recompute_method: RecomputeMethod | None = None
    """With granularity full: `uniform` (every N layers as a unit) or `block` (first N layers per stage)."""
    recompute_num_layers: int | None = Field(default=None, ge=1)
    """With granularity full: layers per recompute unit (uniform) or layers recomputed per stage (block)."""
    recompute_modules: list[RecomputeModule] | None = None
    """With granularity selective: which sub-modules to recompute (default in megatron: core_attn)."""

    def extra_fields(self) -> dict[str, Any]:
        """Overrides other than recompute, to be set on TransformerConfig as they are."""
        return dict(self.model_extra or {})

    def recompute_kwargs(self) -> dict[str, Any]:
        """The recompute settings as TransformerConfig keyword arguments (None values left out)."""
        out: dict[str, Any] = {}
        if self.recompute_granularity is not None:
            out["recompute_granularity"] = self.recompute_granularity.value
        if self.recompute_method is not None:
            out["recompute_method"] = self.recompute_method.value
        if self.recompute_num_layers is not None:
            out["recompute_num_layers"] = self.recompute_num_layers
        if self.recompute_modules is not None:
            out["recompute_modules"] = [m.value for m in self.recompute_modules]
        return out


class MegatronConfig(StrictModel):
    """Parallelism, offload, recompute and checkpoint options of one role on megatron-core."""

    tensor_model_parallel_size: int = Field(default=1, ge=1)
    """TP: split each layer's matrices across this many GPUs (keep within one node)."""
    pipeline_model_parallel_size: int = Field(default=1, ge=1)
    """PP: split the layers into this many stages."""
    virtual_pipeline_model_parallel_size: int | None = Field(default=None, ge=1)
    """VPP: model chunks per pipeline stage (interleaved 1F1B); needs PP > 1."""
    context_parallel_size: int = Field(default=1, ge=1)
    """CP: must be 1. Kept so that pasted configs validate; the training loops do not split sequences
    across context-parallel ranks, so any other value is refused."""
    expert_model_parallel_size: int = Field(default=1, ge=1)
    """EP: split the experts of MoE layers across this many GPUs."""
    expert_tensor_parallel_size: int | None = Field(default=None, ge=1)
    """ETP: TP size inside expert layers; unset means the dense TP size."""
    sequence_parallel: bool = False
    """Shard layer norms and dropout activations along the sequence across the TP group (TP > 1 only)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer states (and fp32 master weights) across data-parallel ranks."""
    overlap_grad_reduce: bool = False
    """Overlap the data-parallel gradient reduction with the backward pass."""
    param_offload: bool = False
    """RL: move this role's parameters to CPU memory while another role runs. Refused for sft/pt: their
    one phase reads every parameter in each forward and backward pass."""
    grad_offload: bool = False
    """RL: move this role's gradient buffers to CPU memory while they are not needed (rollout, other
    roles). Refused for sft/pt: the gradients accumulate on the GPU until the optimizer step."""
    optimizer_offload: bool = False
    """RL: move this role's optimizer states to CPU memory while they are not needed. sft/pt: keep the
    fp32 master weights and Adam states in CPU memory for the whole run and run the optimizer step on the
    CPU (12 bytes per parameter off the GPU, a slower step; docs/parallelism.md)."""
    use_mbridge: bool = False
    """Load the HF checkpoint directly through mbridge instead of a converted dist checkpoint."""
    use_dist_checkpointing: bool = False
    """Load weights from the megatron-core dist checkpoint at dist_checkpointing_path."""
    dist_checkpointing_path: str | None = None
    """Folder written by `trinity convert hf-to-mcore` (or a `trinity run` checkpoint)."""
    moe_token_dispatcher_type: Literal["allgather", "alltoall"] = "alltoall"
    """How MoE tokens reach their experts: all-gather (small EP) or all-to-all (large EP)."""
    moe_grouped_gemm: bool = False
    """Run the local experts as one grouped GEMM instead of a loop of linear layers."""
    moe_layer_recompute: bool = False
    """Recompute MoE layers in the backward pass to save activation memory."""
    torch_compile: Literal["none", "layers", "model"] = "none"
    """`torch.compile` scope: "layers" compiles each transformer layer (one graph for all layers, short
    compile), "model" the whole GPTModel; compile time is paid in the first steps and cached by torch."""
    seed: int = 42
    """Seed for parameter init and dropout (each rank derives its own stream from it)."""
    override_transformer_config: OverrideTransformerConfig = Field(default_factory=OverrideTransformerConfig)
    """Recompute settings and any other megatron-core TransformerConfig field."""

    def layout(self) -> ParallelLayout:
        return ParallelLayout(
            tp=self.tensor_model_parallel_size,
            pp=self.pipeline_model_parallel_size,
            vpp=self.virtual_pipeline_model_parallel_size,
            cp=self.context_parallel_size,
            ep=self.expert_model_parallel_size,
            etp=self.expert_tensor_parallel_size,
        )

    @property
    def any_offload(self) -> bool:
        return self.param_offload or self.grad_offload or self.optimizer_offload
