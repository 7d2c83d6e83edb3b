"""Model facts read from a Hugging Face `config.json`, without importing torch or transformers.

The validator needs layers, heads, experts and vocabulary size before any process starts, and
`trinity validate` must stay instant, so this module reads the JSON itself. The same facts then
drive the megatron-core TransformerConfig (trinity.models.build) and the weight maps
(trinity.convert), so all three agree on one reading of the HF config.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trinity.errors import UserError
from trinity.models.deepseek import MLAFacts, mla_parameters, read_deepseek


@dataclass(frozen=True)
class ArchitectureInfo:
    """What differs between the supported HF architectures, declared once per family."""

    family: str  # key of the weight map in trinity.convert.registry
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    qkv_bias: bool | None = None  # None: read `attention_bias` from the config (Llama)
    moe: bool = False
    mla: bool = False  # DeepSeek: multi-latent attention, leading dense layers, shared experts
    # Gemma: RMSNorm scales by (1 + weight) (megatron's zero-centred gamma), the embedding output is
    # multiplied by sqrt(hidden), each block has a norm after attention and after the MLP too
    # ("sandwich"), and `query_pre_attn_scalar` / logit soft-capping / sliding windows are read.
    gemma: bool = False
    # When config.json has no `layer_types`: every `global_every`-th layer (1-based) attends globally,
    # the others over `sliding_window` (transformers' own default for the architecture).
    global_every: int | None = None
    local_rope: bool = False  # sliding layers have their own RoPE base (Gemma 3's rope_local_base_freq)
    # (final_logit_softcapping, attn_logit_softcapping) where config.json lacks the keys
    softcapping_defaults: tuple[float | None, float | None] = (None, None)
    # transformers applies attn_logit_softcapping (Gemma 2); its Gemma 3 reads the key but never applies it
    attn_softcapping: bool = False
    # Reads `sliding_window` (None: full attention); the window is megatron-core's `window_size` in
    # training and a windowed mask in the rollout decoders (Mistral, Mixtral, Phi-3).
    sliding_window: bool = False
    # Reads `partial_rotary_factor` (top level or in rope_parameters): RoPE on the first fraction of
    # each head's features, megatron-core's `rotary_percent` (Phi-3/4, GLM-4).
    partial_rotary: bool = False
    rotary_interleaved: bool = False  # RoPE rotates adjacent feature pairs (GLM-4), megatron's rotary_interleaved
    shared_expert: bool = False  # MoE layers add a shared expert with a sigmoid gate (Qwen2-MoE)
    # RMSNorm after the attention block and after the MLP, before each residual add (GLM-4).
    post_block_norms: bool = False
    mbridge: bool = True  # mbridge 0.15.1 has a bridge for it (`--backend mbridge`, `use_mbridge`)
    # What transformers assumes when config.json lacks the key (its config class's default)
    partial_rotary_default: float = 1.0  # GLM-4: 0.5
    norm_topk_prob_default: bool = True  # Qwen2-MoE, Qwen3-MoE: False (Mixtral always renormalises)


# HF `architectures[0]` -> family facts. Adding an architecture means one row here and one weight-map
# module in trinity/convert/; never a string test in code.
SUPPORTED_ARCHITECTURES: dict[str, ArchitectureInfo] = {
    "LlamaForCausalLM": ArchitectureInfo(family="llama"),
    "Qwen2ForCausalLM": ArchitectureInfo(family="qwen2", qkv_bias=True),
    "Qwen3ForCausalLM": ArchitectureInfo(family="qwen3", qk_norm=True, qkv_bias=False),
    "Qwen3MoeForCausalLM": ArchitectureInfo(
        family="qwen3_moe", qk_norm=True, qkv_bias=False, moe=True, norm_topk_prob_default=False
    ),
    "MixtralForCausalLM": ArchitectureInfo(family="mixtral", qkv_bias=False, moe=True, sliding_window=True),
    "MistralForCausalLM": ArchitectureInfo(family="mistral", qkv_bias=False, sliding_window=True, mbridge=False),
    "Phi3ForCausalLM": ArchitectureInfo(
        family="phi3", qkv_bias=False, sliding_window=True, partial_rotary=True, mbridge=False
    ),
    "Qwen2MoeForCausalLM": ArchitectureInfo(
        family="qwen2_moe", qkv_bias=True, moe=True, shared_expert=True, norm_topk_prob_default=False
    ),
    "Glm4ForCausalLM": ArchitectureInfo(
        family="glm4", partial_rotary=True, rotary_interleaved=True, post_block_norms=True, mbridge=False,
        partial_rotary_default=0.5,
    ),
    "DeepseekV2ForCausalLM": ArchitectureInfo(family="deepseek_v2", qkv_bias=False, moe=True, mla=True),
    "DeepseekV3ForCausalLM": ArchitectureInfo(family="deepseek_v3", qkv_bias=False, moe=True, mla=True),
    "Gemma2ForCausalLM": ArchitectureInfo(
        family="gemma2", gemma=True, global_every=2, softcapping_defaults=(30.0, 50.0), attn_softcapping=True
    ),
    # text-only Gemma 3 (270M, 1B); Gemma3TextConfig's sliding_window_pattern default is 6
    "Gemma3ForCausalLM": ArchitectureInfo(family="gemma3", gemma=True, qk_norm=True, global_every=6, local_rope=True),
}

# Architectures refused with a reason of their own (a closer alternative than the supported list).
REFUSED_ARCHITECTURES: dict[str, str] = {
    "Gemma3ForConditionalGeneration": (
        "multimodal Gemma 3 (vision tower and projector) is not supported; use a text-only "
        "Gemma3ForCausalLM checkpoint (the 270M and 1B models)"
    ),
}

# rope_scaling types megatron-core computes exactly (trinity.models.build refuses other parameters).
SUPPORTED_ROPE_SCALING = ("llama3",)


def supported_list() -> str:
    return ", ".join(sorted(SUPPORTED_ARCHITECTURES))


# The files of a model or tokenizer folder whose top-level `auto_map` makes transformers import Python
# files of the folder (and ask on a terminal whether to run them).
CUSTOM_CODE_FILES = ("config.json", "tokenizer_config.json")


def refuse_custom_code(folder: str | Path) -> None:
    """UserError naming the file when `folder` carries its own modelling or tokenizer code (`auto_map`).

    trinity never runs code from a model folder: every transformers load passes
    trust_remote_code=False, and such a folder is refused here, where folders are first read, rather
    than failing later inside transformers. A file that is not valid JSON is left to the readers that
    name it as such."""
    for name in CUSTOM_CODE_FILES:
        path = Path(folder) / name
        try:
            raw = json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError):
            continue
        if isinstance(raw, dict) and "auto_map" in raw:
            raise UserError(
                f"{path} has auto_map (custom code); trinity never runs code from a model folder: "
                "use a model whose architecture transformers ships"
            )


@dataclass(frozen=True)
class ModelFacts:
    """The numbers trinity needs from an HF causal-LM config."""

    architecture: str
    family: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int  # = num_key_value_heads
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    num_experts: int | None = None  # None for dense models
    moe_ffn_hidden_size: int | None = None
    moe_router_topk: int | None = None
    moe_norm_topk_prob: bool = True
    hidden_act: str = "silu"
    rope_scaling: dict[str, Any] | None = field(default=None, compare=False)
    # a token of a sliding layer attends to itself and the window - 1 tokens before it (HF's value); the
    # sliding layers: `sliding_layers` (Gemma's pattern), or every layer where that is empty
    sliding_window: int | None = None
    rotary_percent: float = 1.0  # fraction of a head's features that RoPE rotates
    rotary_interleaved: bool = False
    post_block_norms: bool = False
    torch_dtype: str | None = None
    source: str = ""  # the config.json this was read from
    # DeepSeek (trinity.models.deepseek reads these; defaults describe every other family)
    mla: MLAFacts | None = None
    moe_dense_layers: int = 0  # first_k_dense_replace: leading layers with a dense MLP
    # MoE: the shared experts' width (DeepSeek n_shared_experts * moe_intermediate_size, Qwen2-MoE
    # shared_expert_intermediate_size; None: none), and whether a sigmoid gate scales them (Qwen2-MoE)
    moe_shared_ffn_hidden_size: int | None = None
    moe_shared_expert_gate: bool = False
    moe_score_function: str = "softmax"
    moe_scaling_factor: float | None = None  # routed_scaling_factor
    moe_num_groups: int | None = None  # group-limited routing: n_group, topk_group
    moe_group_topk: int | None = None
    moe_group_score_topk: int | None = None  # a group's score: the sum of its top-k (V2 1, V3 2)
    moe_expert_bias: bool = False  # V3: e_score_correction_bias
    mtp_layers: int = 0  # V3 multi-token-prediction layers in the checkpoint (not loaded)
    # Gemma (ArchitectureInfo.gemma): (1 + w) norms, scaled embeddings, sandwich norms
    gemma: bool = False
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    attn_logit_softcapping: float | None = None  # attention scores -> cap * tanh(scores / cap)
    query_pre_attn_scalar: float | None = None  # attention scale = query_pre_attn_scalar ** -0.5
    sliding_layers: tuple[bool, ...] = ()  # per layer (0-based): attends over sliding_window only
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (None: rope_theta)
    global_rope_factor: float | None = None  # linear RoPE scaling of the global layers (Gemma 3)

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "ModelFacts":
        """Read `<path>/config.json`; raise UserError naming the file on any problem."""
        cfg_path = Path(path) / "config.json"
        if not Path(path).exists():
            raise UserError(f"{path}: model folder does not exist")
        if not cfg_path.is_file():
            raise UserError(f"{cfg_path}: no config.json in the model folder")
        try:
            raw = json.loads(cfg_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise UserError(f"{cfg_path}: not valid JSON ({exc})") from None
        refuse_custom_code(path)
        return cls.from_hf_dict(raw, source=str(cfg_path))

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelFacts":
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else None
        if arch in REFUSED_ARCHITECTURES:
            raise UserError(f"{source}: architecture {arch!r}: {REFUSED_ARCHITECTURES[arch]}")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UserError(
                f"{source}: architecture {arch!r} is not supported; supported: {supported_list()}"
            )
        info = SUPPORTED_ARCHITECTURES[arch]

        def need(key: str) -> Any:
            if key not in raw or raw[key] is None:
                raise UserError(f"{source}: missing required field {key!r} for {arch}")
            return raw[key]

        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        # Gemma's head size is its own (256 by transformers' default), not hidden / heads
        head_dim = int(raw.get("head_dim") or (256 if info.gemma else hidden // heads))
        # transformers 5 moved rope_theta into rope_parameters; older configs keep it at top level.
        rope_params = raw.get("rope_parameters") or {}
        rope_theta = float(raw.get("rope_theta") or rope_params.get("rope_theta") or 10000.0)
        rope_type = rope_params.get("rope_type", "default")
        rope_scaling = raw.get("rope_scaling") or (rope_params if rope_type != "default" else None)
        if rope_scaling and not (info.mla or info.gemma):  # DeepSeek's yarn and Gemma 3's are read below
            kind = rope_scaling.get("rope_type") or rope_scaling.get("type")
            if kind not in SUPPORTED_ROPE_SCALING:
                raise UserError(
                    f"{source}: rope_scaling: type {kind!r} is not supported for {arch} (megatron-core computes "
                    f"{', '.join(SUPPORTED_ROPE_SCALING)} only); use a checkpoint without it"
                )
        qkv_bias = info.qkv_bias if info.qkv_bias is not None else bool(raw.get("attention_bias", False))
        window = None if info.gemma else _sliding_window(raw, info, arch, source)  # Gemma: _gemma_fields
        rotary_percent = 1.0
        factor = raw.get("partial_rotary_factor", rope_params.get("partial_rotary_factor", info.partial_rotary_default))
        if factor is not None and float(factor) != 1.0:
            if not info.partial_rotary:
                raise UserError(f"{source}: partial_rotary_factor {factor} is not supported for {arch}")
            rotary_percent = float(factor)
            if float(head_dim * rotary_percent) != int(head_dim * rotary_percent) or int(head_dim * rotary_percent) % 2:
                raise UserError(
                    f"{source}: partial_rotary_factor {factor} of head_dim {head_dim} is not an even number of features"
                )

        extra: dict[str, Any] = {}
        if info.mla:
            extra = read_deepseek(raw, source)
            head_dim = extra["mla"].qk_nope_head_dim + extra["mla"].qk_rope_head_dim
        num_experts = moe_ffn = topk = None
        shared_ffn = extra.pop("moe_shared_ffn_hidden_size", None)
        if info.moe:
            num_experts = int(raw.get("num_local_experts") or raw.get("num_experts") or raw.get("n_routed_experts") or 0) or None
            if num_experts is None:
                raise UserError(f"{source}: MoE architecture {arch} without num_experts/num_local_experts")
            moe_ffn = int(raw.get("moe_intermediate_size") or need("intermediate_size"))
            topk = int(need("num_experts_per_tok"))
            # Qwen-MoE configs may make some layers dense; every layer of our spec is alike
            sparse_step, dense_layers = raw.get("decoder_sparse_step"), raw.get("mlp_only_layers")
            if sparse_step not in (None, 1):
                raise UserError(f"{source}: decoder_sparse_step {sparse_step} is not supported (every layer MoE: 1)")
            if dense_layers:
                raise UserError(f"{source}: mlp_only_layers {dense_layers} is not supported (every layer MoE: [])")
            if info.shared_expert:
                shared_ffn = int(need("shared_expert_intermediate_size"))
                if shared_ffn <= 0:
                    raise UserError(f"{source}: shared_expert_intermediate_size {shared_ffn} must be positive")
        # Mixtral always renormalises the top-k weights; Qwen-MoE reads norm_topk_prob; DeepSeek decides.
        norm_topk_prob = bool(raw.get("norm_topk_prob", info.norm_topk_prob_default)) if info.moe else True
        norm_topk_prob = extra.pop("moe_norm_topk_prob", norm_topk_prob)
        fields: dict[str, Any] = dict(
            architecture=arch,
            family=info.family,
            num_layers=int(need("num_hidden_layers")),
            hidden_size=hidden,
            ffn_hidden_size=int(raw.get("intermediate_size") or 4 * hidden),
            num_attention_heads=heads,
            num_query_groups=kv_heads,
            head_dim=head_dim,
            vocab_size=int(need("vocab_size")),
            max_position_embeddings=int(raw.get("max_position_embeddings") or 4096),
            rope_theta=rope_theta,
            rms_norm_eps=float(raw.get("rms_norm_eps") or 1e-6),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", info.gemma)),  # Gemma ties by default
            qkv_bias=qkv_bias,
            qk_norm=info.qk_norm,
            num_experts=num_experts,
            moe_ffn_hidden_size=moe_ffn,
            moe_router_topk=topk,
            moe_norm_topk_prob=norm_topk_prob,
            # Gemma's config names it hidden_activation (older ones carry both spellings)
            hidden_act=str(raw.get("hidden_activation") or raw.get("hidden_act", "silu")),
            rope_scaling=rope_scaling,
            sliding_window=window,
            rotary_percent=rotary_percent,
            rotary_interleaved=info.rotary_interleaved,
            moe_shared_ffn_hidden_size=shared_ffn,
            moe_shared_expert_gate=info.shared_expert,
            post_block_norms=info.post_block_norms,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            source=source,
            **extra,
        )
        if info.gemma:  # Gemma's own fields, and its RoPE where the config nests it per layer type
            fields.update(_gemma_fields(raw, info, source, fields["num_layers"]))
        return cls(**fields)

    @property
    def sandwich_norms(self) -> bool:
        """A norm after attention and after the MLP too, before each residual add (Gemma)."""
        return self.gemma

    def is_sliding(self, layer: int) -> bool:
        """Whether global layer `layer` (0-based) attends over a sliding window."""
        return bool(self.sliding_layers) and self.sliding_layers[layer]

    def num_parameters(self) -> int:
        """Parameter count of the HF model (used by the memory estimate)."""
        h, L = self.hidden_size, self.num_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_query_groups * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0)
        attn += 2 * self.head_dim if self.qk_norm else 0
        if self.mla is not None:
            attn = mla_parameters(self)
        dense = 3 * h * self.ffn_hidden_size
        if self.is_moe:
            mlp = self.num_experts * 3 * h * self.moe_ffn_hidden_size + h * self.num_experts
            mlp += 3 * h * (self.moe_shared_ffn_hidden_size or 0) + (h if self.moe_shared_expert_gate else 0)
        else:
            mlp = dense
        norms = (4 if self.sandwich_norms or self.post_block_norms else 2) * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        dense_layers = min(self.moe_dense_layers, L)
        return L * (attn + norms) + (L - dense_layers) * mlp + dense_layers * dense + embed + h


def _optional_float(raw: dict[str, Any], key: str, default: float | None) -> float | None:
    value = raw.get(key, default)
    return None if value is None else float(value)


def _gemma_fields(raw: dict[str, Any], info: ArchitectureInfo, source: str, layers: int) -> dict[str, Any]:
    """The Gemma fields of ModelFacts, with transformers' class defaults where config.json lacks a key
    (Gemma2Config / Gemma3TextConfig), and the features trinity cannot run refused naming the field."""
    if raw.get("use_bidirectional_attention"):
        raise UserError(f"{source}: use_bidirectional_attention=true is not supported (causal decoders only)")
    window = raw.get("sliding_window", 4096)
    types = raw.get("layer_types")
    if types is None:
        every = int(raw.get("sliding_window_pattern") or info.global_every or 1)
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    unknown = sorted({t for t in types} - {"sliding_attention", "full_attention"})
    if len(types) != layers or unknown:
        raise UserError(
            f"{source}: layer_types must list 'sliding_attention' or 'full_attention' for each of the "
            f"{layers} layers (got {len(types)} entries{', unknown ' + str(unknown) if unknown else ''})"
        )
    sliding = tuple(t == "sliding_attention" for t in types)
    if any(sliding) and window is None:
        raise UserError(f"{source}: layer_types has sliding_attention layers but sliding_window is null")
    rope = _gemma3_rope(raw, source) if info.local_rope else {}
    attn_cap = _optional_float(raw, "attn_logit_softcapping", info.softcapping_defaults[1])
    if attn_cap is not None and not info.attn_softcapping:
        raise UserError(
            f"{source}: attn_logit_softcapping={attn_cap}: transformers' {raw['architectures'][0]} does not apply it "
            "(its checkpoints have null); set it to null"
        )
    return dict(
        **rope,
        gemma=True,
        final_logit_softcapping=_optional_float(raw, "final_logit_softcapping", info.softcapping_defaults[0]),
        attn_logit_softcapping=attn_cap,
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or 256),
        sliding_window=int(window) if any(sliding) else None,
        sliding_layers=sliding if any(sliding) else (),
    )


_GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}  # Gemma3TextConfig.default_theta


def _gemma3_rope(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """Gemma 3's two RoPEs: global layers at `rope_theta` (linear scaling allowed), sliding layers at
    `rope_local_base_freq` (default RoPE only). transformers 5 writes them as
    rope_parameters = {"full_attention": {...}, "sliding_attention": {...}}; older configs as rope_theta,
    rope_local_base_freq and rope_scaling (of the global layers), which transformers reads the same way."""
    nested = raw.get("rope_parameters")
    if isinstance(nested, dict) and ("full_attention" in nested or "sliding_attention" in nested):
        params = {k: dict(nested.get(k) or {}) for k in _GEMMA3_THETA}
        where = {k: f"rope_parameters.{k}" for k in _GEMMA3_THETA}
    else:
        legacy = dict(nested or {})
        full = {**legacy, **(raw.get("rope_scaling") or {})}
        if raw.get("rope_theta") is not None:
            full["rope_theta"] = raw["rope_theta"]
        local = {"rope_type": "default"}
        if raw.get("rope_local_base_freq") is not None:
            local["rope_theta"] = raw["rope_local_base_freq"]
        params = {"full_attention": full, "sliding_attention": local}
        where = {"full_attention": "rope_scaling", "sliding_attention": "rope_local_base_freq"}
    kinds = {k: p.get("rope_type") or p.get("type") or "default" for k, p in params.items()}
    if kinds["full_attention"] not in ("default", "linear"):
        raise UserError(
            f"{source}: {where['full_attention']}: rope_type {kinds['full_attention']!r} of the global layers is not "
            "supported (default or linear)"
        )
    if kinds["sliding_attention"] != "default":
        raise UserError(
            f"{source}: {where['sliding_attention']}: rope_type {kinds['sliding_attention']!r} of the sliding layers "
            "is not supported (default only)"
        )
    full = params["full_attention"]
    factor = float(full.get("factor", 1.0)) if kinds["full_attention"] == "linear" else None
    return dict(
        rope_theta=float(full.get("rope_theta") or _GEMMA3_THETA["full_attention"]),
        rope_local_theta=float(params["sliding_attention"].get("rope_theta") or _GEMMA3_THETA["sliding_attention"]),
        global_rope_factor=factor if factor != 1.0 else None,
        rope_scaling=None,  # taken apart above: global_rope_factor
    )


def _sliding_window(raw: dict[str, Any], info: ArchitectureInfo, arch: str, source: str) -> int | None:
    """The attention window of a config that uses one (None: full attention); UserError naming the field
    where the family's window is not implemented."""
    window = raw.get("sliding_window")
    if "use_sliding_window" in raw and not raw["use_sliding_window"]:
        window = None  # Qwen2-style configs carry a window they only use when asked to
    if not window:
        return None
    if not info.sliding_window:
        raise UserError(f"{source}: sliding_window {window} is not supported for {arch}; set it to null")
    if int(window) < 1:
        raise UserError(f"{source}: sliding_window {window} must be a positive number of tokens or null")
    return int(window)


def mbridge_refusal(facts: "ModelFacts") -> str | None:
    """Why mbridge cannot convert this model (None: it can)."""
    if SUPPORTED_ARCHITECTURES[facts.architecture].mbridge:
        return None
    return f"mbridge 0.15.1 has no bridge for {facts.architecture}; use the builtin converter"
