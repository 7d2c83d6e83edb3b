"""megatron-core GPTModel chunks from HF model facts and a role's `megatron:` block.

`megatron` is anything with the attributes of `trinity.config.megatron.MegatronConfig` (duck-typed so
tests and tools can pass a SimpleNamespace). Parallel state must be initialised first
(`trinity.distributed.parallel.init_parallel`); on CPU that also enables cpu_compat.

Choices made here:
- MoE load balancing: `moe_router_load_balancing_type="none"` and no aux loss. Fine-tuning (SFT/RL)
  starts from a balanced router and the HF families here train without the aux loss by default
  (`output_router_logits=False`); set `moe_router_load_balancing_type: aux_loss` and
  `moe_aux_loss_coeff` in override_transformer_config to add it.
- Routing: Mixtral and Qwen3-MoE with `norm_topk_prob=True` softmax over the top-k logits (= the
  renormalised top-k probabilities): `moe_router_pre_softmax=False`. Qwen3-MoE with
  `norm_topk_prob=False` takes top-k of the full softmax: `moe_router_pre_softmax=True`.
- Fusions: on CPU every fusion is off; on CUDA the torch-jit ones (bias-SwiGLU, bias-dropout-add) are
  on, and so is RoPE's for eager layers (TE's kernel, or ours from `trinity.models.rope` without TE;
  with `torch_compile` inductor fuses it). masked_softmax_fusion imports apex, moe_permute_fusion
  needs TE, gradient_accumulation_fusion and persist_layer_norm need apex.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from trinity.models.doc_masks import block_causal_mask
from trinity.distributed.wrappers import unwrap
from trinity.errors import UserError
from trinity.models import rope
from trinity.models import spec as specs
from trinity.models.attention import causal_mask, document_packed_params, packed_causal_mask
from trinity.models.facts import ModelFacts

log = logging.getLogger(__name__)

def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """transformers' gelu_pytorch_tanh (Gemma's MLP activation)."""
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": gelu_tanh}
# torch.compile scope (megatron block field `torch_compile`): "layers" compiles each TransformerLayer
# (one graph reused by every layer: short compile, works with recompute and pipeline chunks), "model"
# the whole GPTModel (fuses across layer boundaries too).
COMPILE_SCOPES = ("none", "layers", "model")
_VOCAB_MULTIPLE = 128


def padded_vocab_size(facts: ModelFacts, tp: int) -> int:
    """Vocabulary rounded up to a multiple of 128*TP (Megatron-LM's make-vocab-size-divisible-by)."""
    multiple = _VOCAB_MULTIPLE * tp
    return -(-facts.vocab_size // multiple) * multiple


def _value(x: Any) -> Any:
    return getattr(x, "value", x)  # str enums of the job config -> plain str


def _recompute_kwargs(override: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("recompute_granularity", "recompute_method", "recompute_num_layers"):
        value = getattr(override, name, None)
        if value is not None:
            out[name] = _value(value)
    modules = getattr(override, "recompute_modules", None)
    if modules is not None:
        out["recompute_modules"] = [_value(m) for m in modules]
    if out.get("recompute_granularity") == "full":
        # megatron requires a method and count with full granularity; one layer per unit, uniform.
        out.setdefault("recompute_method", "uniform")
        out.setdefault("recompute_num_layers", 1)
    return out


def _rope_scaling_kwargs(facts: ModelFacts) -> dict[str, Any]:
    rs = facts.rope_scaling
    if not rs or facts.mla is not None:  # MLA layers hold their own RoPE (trinity.models.deepseek)
        return {}
    kind = rs.get("rope_type") or rs.get("type")
    # megatron-core's built-in scaling is Llama 3.1's with fixed low/high frequency factors and 8192.
    llama3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    if kind == "llama3" and all(float(rs.get(k, v)) == v for k, v in llama3.items()):
        return {"rope_scaling": True, "rope_scaling_factor": float(rs.get("factor", 8.0))}
    raise UserError(f"{facts.source}: rope scaling {rs} is not supported (only Llama 3.1's llama3)")


def _window_kwargs(facts: ModelFacts) -> dict[str, Any]:
    """megatron's sliding-window fields: transformers' window counts the query itself, megatron's
    window_size[0] the keys before it; a per-layer list says which layers slide (1 = sliding; Gemma's
    pattern), none: every layer (Mistral, Phi-3)."""
    if facts.sliding_window is None:
        return {}
    if not facts.sliding_layers:
        return {"window_size": (facts.sliding_window - 1, 0)}
    return {"window_size": (facts.sliding_window - 1, 0), "window_attn_skip_freq": [int(s) for s in facts.sliding_layers]}


def transformer_config(
    facts: ModelFacts, megatron: Any, *, device: str, dtype: torch.dtype, weights_only: bool = False
) -> TransformerConfig:
    """The megatron-core TransformerConfig for `facts` under the role's parallel/recompute settings.
    `weights_only`: see `build_model`."""
    if facts.hidden_act not in _ACTIVATIONS:
        raise UserError(
            f"{facts.source}: hidden_act {facts.hidden_act!r} is not supported (one of {sorted(_ACTIVATIONS)})"
        )
    on_cpu = device == "cpu"
    if on_cpu and dtype != torch.float32 and not weights_only:
        raise UserError(f"model.dtype: {dtype} on cpu; CPU runs in float32")
    override = megatron.override_transformer_config
    tp = megatron.tensor_model_parallel_size
    kwargs: dict[str, Any] = dict(
        num_layers=facts.num_layers,
        hidden_size=facts.hidden_size,
        ffn_hidden_size=facts.ffn_hidden_size,
        num_attention_heads=facts.num_attention_heads,
        num_query_groups=facts.num_query_groups,
        kv_channels=facts.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=facts.rms_norm_eps,
        # Gemma's norms scale by (1 + weight): trinity.models.layer.ZeroCenteredRMSNorm
        layernorm_zero_centered_gamma=facts.gemma,
        softmax_scale=facts.query_pre_attn_scalar**-0.5 if facts.query_pre_attn_scalar else None,
        **_window_kwargs(facts),
        gated_linear_unit=True,
        activation_func=_ACTIVATIONS[facts.hidden_act],
        add_bias_linear=False,
        add_qkv_bias=facts.qkv_bias,
        qk_layernorm=facts.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        attention_softmax_in_fp32=True,
        # RL batches change length between micro-batches; with PP the stages then exchange shapes
        # first. megatron refuses it with the allgather MoE dispatcher (pad to one length there).
        variable_seq_lengths=megatron.pipeline_model_parallel_size > 1
        and megatron.moe_token_dispatcher_type != "allgather",
        # The interleaved schedule sends activations forward and gradients backward in one exchange.
        # At PP=2 both go to the same peer, and batch_isend_irecv matches a pair's messages in posting
        # order, so the activation can land in the gradient's buffer (wrong losses from the third
        # micro batch on, measured on gloo). megatron's unbatched p2p puts one direction on another
        # process group; Megatron-LM also turns it on for interleaving (overlap_p2p_comm).
        overlap_p2p_comm=bool(megatron.virtual_pipeline_model_parallel_size),
        batch_p2p_comm=not megatron.virtual_pipeline_model_parallel_size,
        moe_token_dispatcher_type=megatron.moe_token_dispatcher_type,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=megatron.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=megatron.virtual_pipeline_model_parallel_size,
        context_parallel_size=megatron.context_parallel_size,
        expert_model_parallel_size=megatron.expert_model_parallel_size,
        expert_tensor_parallel_size=megatron.expert_tensor_parallel_size or tp,
        sequence_parallel=bool(megatron.sequence_parallel) and tp > 1,
        use_cpu_initialization=on_cpu,
        # Random init of a model whose every parameter is about to be overwritten costs seconds per
        # GB on a CPU (conversion).
        perform_initialization=not weights_only,
        masked_softmax_fusion=False,
        # Eager CUDA layers: one RoPE kernel each way (TE's, or trinity.models.rope without TE). Under
        # torch_compile, inductor fuses megatron's unfused RoPE into its neighbours, and an opaque
        # fused op there measured slower (H200, per-layer compile: 0.5B 0.097 -> 0.118 s, 1.5B
        # 0.174 -> 0.191 s per step). CPU keeps megatron's unfused reference numerics.
        # (our fused RoPE rotates halves, not interleaved pairs: GLM-4 keeps megatron's unfused RoPE)
        apply_rope_fusion=not on_cpu and compile_scope(megatron) == "none" and not facts.rotary_interleaved
        and rope.install(),
        # megatron fuses bias + SwiGLU (and exact GELU), not GELU-tanh
        bias_activation_fusion=not on_cpu and facts.hidden_act == "silu",
        bias_dropout_fusion=not on_cpu,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        cross_entropy_loss_fusion=False,
    )
    if facts.rotary_percent != 1.0 or facts.rotary_interleaved:
        kwargs.update(rotary_interleaved=facts.rotary_interleaved)
    if facts.is_moe:
        kwargs.update(
            num_moe_experts=facts.num_experts,
            moe_ffn_hidden_size=facts.moe_ffn_hidden_size,
            moe_router_topk=facts.moe_router_topk,
            moe_router_pre_softmax=not facts.moe_norm_topk_prob,
            moe_router_score_function=facts.moe_score_function,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_router_dtype="fp32",
            moe_grouped_gemm=bool(megatron.moe_grouped_gemm),
            moe_layer_recompute=bool(megatron.moe_layer_recompute),
        )
        if facts.moe_shared_ffn_hidden_size:
            # shared experts on every token (DeepSeek's; Qwen2-MoE's scaled by sigmoid(gate . x))
            kwargs.update(moe_shared_expert_intermediate_size=facts.moe_shared_ffn_hidden_size,
                          moe_shared_expert_gate=facts.moe_shared_expert_gate)
    config_class = TransformerConfig
    if facts.mla is not None:
        from trinity.models import deepseek

        kwargs.update(deepseek.config_kwargs(facts))
        config_class = MLATransformerConfig
    kwargs.update(_recompute_kwargs(override))
    extra = dict(override.extra_fields())
    known = set(config_class.__dataclass_fields__)
    unknown = sorted(set(extra) - known)
    if unknown:
        raise UserError(f"override_transformer_config: unknown TransformerConfig field(s) {unknown}")
    kwargs.update(extra)
    try:
        return config_class(**kwargs)
    except (ValueError, AssertionError) as exc:
        raise UserError(f"megatron settings rejected by megatron-core TransformerConfig: {exc}") from None


class ValueHead(torch.nn.Linear):
    """Scalar head replacing `output_layer` for the PPO critic: weight [1, hidden], no bias.

    Replicated on every TP rank (one output cannot be split). Under sequence parallel the hidden
    states are sequence shards, so the output is gathered and the weight tagged `sequence_parallel`
    for finalize_model_grads to sum its partial grads (as verl's LinearForLastLayer)."""

    def __init__(self, config: TransformerConfig):
        super().__init__(config.hidden_size, 1, bias=False, dtype=config.params_dtype)
        self.sequence_parallel = config.sequence_parallel
        self.weight.sequence_parallel = config.sequence_parallel
        # Its own generator seeded from the job's seed: the default stream's state here depends on how
        # much the layers' init drew before, i.e. on the layout, and a job must start from the same
        # critic at any TP/PP (init_parallel seeds seed + 100 * PP rank; the head is on the last stage).
        seed = torch.initial_seed() - 100 * ps.get_pipeline_model_parallel_rank()
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, generator=gen) * config.init_method_std)

    def forward(self, hidden: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None):  # type: ignore[override]
        values = super().forward(hidden)
        if self.sequence_parallel:
            values = tensor_parallel.gather_from_sequence_parallel_region(
                values, tensor_parallel_output_grad=False
            )
        return values, None


def packed_attention(model: torch.nn.Module, doc_ids: torch.Tensor, device: torch.device) -> dict[str, Any]:
    """GPTModel.forward's attention arguments for packed rows, `doc_ids` [b, s] (-1 = padding,
    trinity.models.doc_masks; on the CPU, the boundaries need no GPU sync). Our layer spec gets the document boundaries once per micro batch (flash
    varlen on CUDA: no [b, 1, s, s] mask read by every layer); TransformerEngine gets the dense mask."""
    inner = unwrap(model)
    cp = inner.config.context_parallel_size
    if getattr(inner, "trinity_backend", None) == specs.BACKEND_TE:
        if cp > 1:  # TE's CP attention is causal over whole rows only (packed rows would need its thd layout)
            if not _one_document_rows(doc_ids):
                raise UserError("megatron.context_parallel_size > 1 with TransformerEngine trains unpacked rows only "
                                "(SFT with data.packing: false, pt, DPO): set context_parallel_size 1, or run without "
                                "TransformerEngine (ring attention)")
            # one document then padding: causal attention is the document mask (padding sees only itself
            # or the document, and no loss reads it)
            return {"attention_mask": None}
        return {"attention_mask": block_causal_mask(doc_ids.to(device, non_blocking=True))}
    if cp > 1:  # ring attention: the whole rows' document ids (each rank finds any block's ids in them)
        from trinity.models.ring_attention import ring_document_params

        if _one_document_rows(doc_ids):
            # unpacked rows: causal attention is their document mask (trailing padding is read by no loss),
            # and without a mask the ring runs torch's flash kernel per block (ids on the GPU, DPO's: one
            # small copy per micro batch, against a forward long enough to need CP)
            return {"attention_mask": None}

        return {"attention_mask": None, "packed_seq_params": ring_document_params(doc_ids, device=device)}
    return {"attention_mask": None, "packed_seq_params": document_packed_params(doc_ids, device=device)}


def _one_document_rows(doc_ids: torch.Tensor) -> bool:
    """Whether every row of `doc_ids` [b, s] is one document (0) then padding (-1) only."""
    d = doc_ids.cpu() if doc_ids.is_cuda else doc_ids
    return bool(((d == 0) | (d == -1)).all() and (d[:, 1:] <= d[:, :-1]).all())


def _scale_embedding(scale: float) -> Any:
    rounded: dict[torch.dtype, float] = {}

    def hook(module: torch.nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        # the scale rounded to the activations' dtype, as transformers multiplies (sqrt(hidden) in bf16
        # under bf16); a Python number, so that no host-to-device copy breaks a CUDA graph's capture
        if out.dtype not in rounded:
            rounded[out.dtype] = torch.tensor(scale, dtype=torch.float32).to(out.dtype).item()
        return out * rounded[out.dtype]

    return hook


def _softcap_logits(cap: float) -> Any:
    def hook(module: torch.nn.Module, args: Any, out: tuple[torch.Tensor, Any]) -> tuple[torch.Tensor, Any]:
        logits, bias = out
        return torch.tanh(logits / cap) * cap, bias

    return hook


def _model_options(model: GPTModel, facts: ModelFacts, *, value_head: bool) -> None:
    """Model-level options GPTModel lacks, as forward hooks on its submodules (so that every caller of
    `embedding` / `output_layer`, the rollout decoders included, gets them): Gemma's embedding scale
    sqrt(hidden) and final-logit soft-capping (elementwise, so any TP shard of the vocabulary caps alike;
    not on the critic's value head); Gemma 3's linear RoPE scaling of the global layers (the model's
    table; its sliding layers have their own, trinity.models.layer)."""
    if facts.gemma and model.pre_process:
        model.embedding.register_forward_hook(_scale_embedding(facts.hidden_size**0.5))
    if facts.global_rope_factor is not None:
        # linear RoPE scaling as transformers computes it (inverse frequencies / factor; megatron's
        # seq_len_interpolation_factor divides the positions instead, which rounds differently), before
        # the first forward fills the table's cache
        model.rotary_pos_emb.inv_freq = model.rotary_pos_emb.inv_freq / facts.global_rope_factor
    if facts.final_logit_softcapping is not None and model.post_process and not value_head:
        model.output_layer.register_forward_hook(_softcap_logits(facts.final_logit_softcapping))


def compile_scope(megatron: Any) -> str:
    """The `torch_compile` scope the role asks for (True / False from older configs mean layers / none)."""
    scope = getattr(megatron, "torch_compile", "none")
    if scope is None or isinstance(scope, bool):
        scope = "layers" if scope else "none"
    if scope not in COMPILE_SCOPES:
        raise UserError(f"megatron.torch_compile: {scope!r} is not one of {list(COMPILE_SCOPES)}")
    return scope


def _apply_compile(model: GPTModel, scope: str) -> None:
    # Module.compile keeps the module object and its parameter names (DDP, checkpoints, weight maps).
    if scope == "layers":
        for layer in model.decoder.layers:
            layer.compile()
    elif scope == "model":
        model.compile()


def build_model(
    facts: ModelFacts,
    megatron: Any,
    *,
    device: str,
    dtype: torch.dtype,
    value_head: bool = False,
    weights_only: bool = False,
) -> list[GPTModel]:
    """One GPTModel per virtual pipeline stage of this rank, on `device` (see trinity.models.spec for
    the parameter names). `value_head=True` gives the critic: output_layer is a [1, hidden] head.
    `weights_only=True` gives a holder of weights that are all overwritten next (conversion): no
    random initialisation (parameters hold garbage until loaded) and any dtype on the CPU, where
    megatron-core only computes in float32 (so do not run it)."""
    config = transformer_config(facts, megatron, device=device, dtype=dtype, weights_only=weights_only)
    tp = ps.get_tensor_model_parallel_world_size()
    if tp != config.tensor_model_parallel_size:
        raise RuntimeError(
            f"parallel state has TP={tp} but the config asks TP={config.tensor_model_parallel_size}; "
            "call init_parallel with this role's layout first"
        )
    vpp = config.virtual_pipeline_model_parallel_size
    if config.moe_grouped_gemm and facts.is_moe:
        from megatron.core.transformer.moe import grouped_gemm_util

        if specs.backend(config, facts) != specs.BACKEND_TE and not grouped_gemm_util.grouped_gemm_is_available():
            raise UserError(
                "megatron.moe_grouped_gemm: needs TransformerEngine or the grouped_gemm package; "
                "set it to false (experts then run as a loop of linear layers)"
            )
    chosen = specs.backend(config, facts)
    scope = compile_scope(megatron)
    if config.context_parallel_size > 1 and chosen != specs.BACKEND_TE:
        # ring attention (trinity.models.ring_attention); validation refuses what it cannot do
        if scope != "none":
            raise UserError("megatron.torch_compile: must be none with context_parallel_size > 1 (ring attention's "
                            "send/receive between CP ranks does not trace)")
        from trinity.compat.rope import install_cp_pos_emb
        from trinity.distributed.context_parallel import pos_emb_on_this_rank

        install_cp_pos_emb(pos_emb_on_this_rank)
    log.info("layer spec: %s, torch.compile: %s", chosen, scope)
    tied = facts.tie_word_embeddings and not value_head
    chunks: list[GPTModel] = []
    for stage in range(vpp or 1):
        vp_stage = stage if vpp else None
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        model = GPTModel(
            config=config,
            transformer_layer_spec=specs.block_spec(facts, config, vp_stage=vp_stage),
            vocab_size=padded_vocab_size(facts, tp),
            max_sequence_length=facts.max_position_embeddings,
            pre_process=pre,
            post_process=post,
            parallel_output=True,
            share_embeddings_and_output_weights=tied,
            position_embedding_type="rope",
            rotary_base=facts.rope_theta,
            rotary_percent=facts.rotary_percent,
            vp_stage=vp_stage,
            **_rope_scaling_kwargs(facts),
        )
        if value_head and post:
            model.output_layer = ValueHead(config)
        _model_options(model, facts, value_head=value_head)
        model.to(device=device)
        _apply_compile(model, scope)
        model.trinity_backend = chosen  # which layer implementation built it (logged, tested)
        chunks.append(model)
    return chunks


__all__ = [
    "COMPILE_SCOPES", "ValueHead", "build_model", "compile_scope", "causal_mask", "packed_attention", "packed_causal_mask",
    "padded_vocab_size", "transformer_config", "unwrap",
]
