"""Core attention on torch's scaled_dot_product_attention, a drop-in for megatron's DotProductAttention.

megatron-core's local DotProductAttention materialises the [b, heads, s, s] score matrix and repeats
K/V for GQA; without TransformerEngine that is the only local option. SDPA dispatches to the flash /
memory-efficient kernels on CUDA (and a fused kernel on CPU), which the lent GPUs measured at 2.6x the
step throughput at 0.9B and a quarter of the memory (docs/../shared notes gpu-measurements).

Conventions are megatron's: q [sq, b, heads, d], k/v [sk, b, groups, d], output [sq, b, heads*d];
`attention_mask` is boolean with True = masked out, broadcastable to [b, 1|heads, sq, sk].

Sliding windows are megatron-core's TransformerConfig fields: `window_size[0]` keys before the query
(transformers' sliding_window minus one: its window counts the query itself) on the layers
`window_attn_skip_freq` names (`layer_window`); the window becomes part of the boolean mask. `softcap`
(a ModuleSpec param, Gemma 2) caps the scores to softcap * tanh(scores / softcap) before the softmax;
SDPA cannot, so a capped layer runs `softcapped_attention` (the ops of transformers' eager attention).
Both take the dense mask for packed rows.

Packed rows (several documents per row) have two forms:
- a dense block-diagonal boolean mask (`packed_causal_mask`): simple, but SDPA then runs its masked
  (memory-efficient) kernel and reads an [b, 1, s, s] mask in every layer (2.6x the causal
  kernel's time at 0.5B on an H200, `python benchmarks/attention.py`);
- `document_packed_params(doc_ids)`: a PackedSeqParams built once per batch that every layer reuses,
  carrying the document boundaries for torch's flash varlen kernel (or a FlexAttention BlockMask).
  megatron passes `packed_seq_params` to each layer by closure (not through its checkpoint's saved
  tensors), and with qkv_format "sbhd" it leaves q/k/v and RoPE as for unpacked rows (RoPE depends
  only on the distance between positions, so a document need not start at position 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide

# Mask types whose meaning with attention_mask=None is "causal".
_CAUSAL_TYPES = (AttnMaskType.causal,)


def causal_mask(sq: int, sk: int | None = None, device: torch.device | str = "cpu") -> Tensor:
    """Boolean causal mask, True = masked, shape [1, 1, sq, sk]; queries are the last sq positions
    of the sk keys (bottom-right aligned, as during cached decoding)."""
    sk = sq if sk is None else sk
    q_pos = torch.arange(sk - sq, sk, device=device).unsqueeze(1)
    k_pos = torch.arange(sk, device=device).unsqueeze(0)
    return (k_pos > q_pos).view(1, 1, sq, sk)


def packed_causal_mask(doc_ids: Tensor) -> Tensor:
    """Block-diagonal causal mask for packed rows: `doc_ids` [b, s] holds each token's document
    index; a token sees earlier tokens of its own document only. Returns [b, 1, s, s], True = masked."""
    same_doc = doc_ids.unsqueeze(2) == doc_ids.unsqueeze(1)
    s = doc_ids.size(1)
    return ~same_doc.unsqueeze(1) | causal_mask(s, device=doc_ids.device)


def outside_window(sq: int, window: int, sk: int | None = None, device: torch.device | str = "cpu") -> Tensor:
    """[1, 1, sq, sk] boolean, True where a key lies more than `window` positions before its query (queries
    are the last sq of the sk keys): what a sliding window masks on top of the causal mask."""
    sk = sq if sk is None else sk
    q_pos = torch.arange(sk - sq, sk, device=device).unsqueeze(1)
    k_pos = torch.arange(sk, device=device).unsqueeze(0)
    return (k_pos < q_pos - window).view(1, 1, sq, sk)


def layer_window(config: TransformerConfig, layer_number: int) -> int | None:
    """How many keys before the query a layer's attention sees (megatron-core's `window_size[0]` where
    `window_attn_skip_freq` makes layer `layer_number`, 1-based and global, a window layer), None: all."""
    if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
        return int(config.window_size[0])
    return None


def softcapped_attention(q: Tensor, k: Tensor, v: Tensor, attend: Optional[Tensor], scale: float,
                         softcap: Optional[float], dropout_p: float = 0.0) -> Tensor:
    """Attention with the scores capped to softcap * tanh(scores / softcap) (None: not capped), the ops
    and roundings of transformers' eager attention (Gemma 2): scores in q's dtype, softmax in fp32.
    q [b, heads, sq, d], k/v [b, groups, sk, d]; `attend` boolean, True = attend, broadcastable to
    [b, heads, sq, sk] (None: every key). Returns [b, heads, sq, d]."""
    rep = q.size(1) // k.size(1)
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attend is not None:
        scores = scores.masked_fill(~attend, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs, v)


THD_NEEDS_TE = (
    "packed_seq_params in thd format needs TransformerEngine; pass "
    "trinity.models.attention.document_packed_params(doc_ids) or a block-diagonal "
    "attention_mask (packed_causal_mask) instead"
)

PACKED_KERNELS = ("auto", "varlen", "flex", "documents", "dense")
"""How packed rows attend: `varlen` (torch's flash kernel over document boundaries, CUDA, bf16/fp16),
`flex` (FlexAttention with a block mask, CUDA), `documents` (the documents gathered into a padded batch
of their own, SDPA over [documents, longest document]), `dense` (SDPA with the [b, 1, s, s] mask).
`auto` picks varlen when torch has the flash ops, else flex, on CUDA; on the CPU `documents` where its
score matrices are smaller than the dense mask's, else dense. Varlen layers in fp32 use the dense mask.
H200 (`python benchmarks/train_step.py --packed`): varlen packed 7B rows run 3% faster than unpacked ones
(documents skip each other's blocks), flex at par; the dense mask takes 2.6x the causal kernel's time
(`python benchmarks/attention.py`)."""


@dataclass
class DocumentPackedParams(PackedSeqParams):
    """Packed rows in megatron's sbhd layout, with the document boundaries in the form the kernel needs.

    `max_seqlen_q/kv` stay the row length: megatron sizes the rotary table from them."""

    doc_ids: Optional[Tensor] = None  # [b, s] on the layers' device
    block_mask: Any = None  # flex: torch.nn.attention.flex_attention.BlockMask, [b, 1, s, s]
    doc_cu_seqlens: Optional[Tensor] = None  # varlen: int32 starts of each document in the flattened rows
    doc_max_seqlen: int = 0  # varlen: longest document
    documents: Optional["DocumentBatch"] = None  # documents: the gather of each document into its own row
    _dense: Optional[Tensor] = None

    def dense_mask(self) -> Tensor:
        """The same mask as a boolean [b, 1, s, s] tensor (True = masked), built once."""
        if self._dense is None:
            self._dense = packed_causal_mask(self.doc_ids)
        return self._dense


@dataclass
class DocumentBatch:
    """Packed rows' documents as a padded batch of their own (the `documents` kernel).

    Why: on the CPU, SDPA with the dense block-diagonal mask computes every row's full [s, s] scores;
    an RL micro batch packs ~100 short sequences into a row of a few thousand tokens, and those scores
    were most of a tiny model's step. Here token j of document i is flat token `index[i, j]` of the
    [b * s] rows; `valid` marks the document's own tokens, `mask` [n, 1, longest, longest] lets a token
    attend to the earlier tokens of its document (True = attend). Documents tile the rows in order, so
    the valid entries, read in order, are the flat tokens in order."""

    index: Tensor  # [n, longest] long
    valid: Tensor  # [n, longest] bool
    mask: Tensor  # [n, 1, longest, longest] bool


def document_batch(doc_ids: Tensor) -> Optional[DocumentBatch]:
    """The `DocumentBatch` of `doc_ids` [b, s] (a row's padding, -1, is one more document), or None when
    its score matrices (documents x longest^2) would not be smaller than the dense mask's (b x s^2) or a
    document's tokens are not contiguous."""
    b, s = doc_ids.shape
    row = torch.arange(b, device=doc_ids.device).repeat_interleave(s)
    seg = row * (s + 1) + doc_ids.reshape(-1)  # one value per (row, document)
    start = torch.ones(b * s, dtype=torch.bool, device=doc_ids.device)
    start[1:] = seg[1:] != seg[:-1]
    starts = start.nonzero().squeeze(1)
    if starts.numel() != torch.unique(seg).numel():  # a document in pieces: the dense mask's rule
        return None
    lengths = torch.diff(starts, append=starts.new_tensor([b * s]))
    longest = int(lengths.max())
    if starts.numel() * longest * longest >= b * s * s:
        return None
    pos = torch.arange(longest, device=doc_ids.device)
    valid = pos.unsqueeze(0) < lengths.unsqueeze(1)
    index = torch.where(valid, starts.unsqueeze(1) + pos.unsqueeze(0), starts.unsqueeze(1))
    mask = (pos.view(1, -1) <= pos.view(-1, 1)).view(1, 1, longest, longest) & valid.view(-1, 1, 1, longest)
    return DocumentBatch(index=index, valid=valid, mask=mask)


def _document_attention(query: Tensor, key: Tensor, value: Tensor, docs: DocumentBatch, scale: float,
                        dropout_p: float) -> Tensor:
    """SDPA per document (`DocumentBatch`): q [s, b, heads, d], k/v [s, b, groups, d] in megatron's layout;
    returns [s, b, heads * d]. A padded query attends to its document's first token (no empty softmax)
    and its output is dropped."""
    sq, b, heads, d = query.shape

    def per_document(x: Tensor) -> Tensor:  # [s, b, h, d] -> [n, h, longest, d]
        return x.transpose(0, 1).reshape(b * sq, x.size(2), x.size(3))[docs.index].transpose(1, 2)

    out = F.scaled_dot_product_attention(per_document(query), per_document(key), per_document(value),
                                         attn_mask=docs.mask, dropout_p=dropout_p, scale=scale,
                                         enable_gqa=heads != key.size(2))
    out = out.transpose(1, 2)[docs.valid]  # [b * s, heads, d_v], the flat tokens in order
    return out.view(b, sq, heads * value.size(3)).transpose(0, 1).contiguous()


def _varlen_available() -> bool:
    """torch's flash-attention ops (the CUDA builds of torch >= 2.3 have them)."""
    return hasattr(torch.ops.aten, "_flash_attention_forward") and torch.cuda.is_available()


class _FlashVarlen(torch.autograd.Function):
    """Causal flash attention over the documents of flattened rows, straight on torch's flash ops. Through
    torch.nn.attention.varlen's custom-op wrapper a host-bound 0.5B step with packed rows measured 34%
    slower than unpacked, through this Function 1.6% (H200, benchmarks/NOTES.md)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, cu: Tensor, longest: int, scale: float) -> Tensor:
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, longest, longest, 0.0, True, False, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse, cu, rng, unused)
        ctx.longest, ctx.scale = longest, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        q, k, v, out, lse, cu, rng, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad.contiguous(), q, k, v, out, lse, cu, cu, ctx.longest, ctx.longest, 0.0, True, rng, unused,
            scale=ctx.scale,
        )
        return dq, dk, dv, None, None, None


def _bucketed(cu: Tensor, total: int) -> Tensor:
    """Pad the boundaries with empty documents to a power-of-two count (>= 16): compiled layers then
    see a few shapes instead of one per document count, and the kernel skips empty documents."""
    n = max(16, 1 << (cu.numel() - 1).bit_length())
    return torch.cat([cu, cu.new_full((n - cu.numel(),), total)])


def document_packed_params(
    doc_ids: Tensor, *, device: torch.device | str | None = None, kernel: str = "auto"
) -> DocumentPackedParams:
    """Block-diagonal causal attention for packed rows, built once per batch and reused by every layer.

    `doc_ids` [b, s]: each token's document within its row (a row's padding is one more document).
    Pass them on the CPU with `device` set to the layers' device: the varlen boundaries are then
    computed without waiting for the GPU."""
    if kernel not in PACKED_KERNELS:
        raise ValueError(f"kernel={kernel!r} is not one of {PACKED_KERNELS}")
    device = torch.device(device) if device is not None else doc_ids.device
    b, s = doc_ids.shape
    docs = doc_ids.to(device, non_blocking=True).contiguous()
    params = DocumentPackedParams(qkv_format="sbhd", max_seqlen_q=s, max_seqlen_kv=s, doc_ids=docs)
    if kernel == "auto" and device.type != "cuda":
        kernel = "documents"
    elif kernel == "auto":
        kernel = "varlen" if _varlen_available() else "flex"
    if kernel == "varlen":
        from trinity.models.doc_masks import cu_seqlens

        cu, params.doc_max_seqlen = cu_seqlens(doc_ids.cpu() if device.type == "cuda" else doc_ids)
        params.doc_cu_seqlens = _bucketed(cu, b * s).to(device, non_blocking=True)
    elif kernel == "documents":  # falls back to the dense mask where that is the smaller computation
        params.documents = document_batch(docs)
    elif kernel == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        def same_doc_causal(batch: Tensor, head: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return (q_idx >= kv_idx) & (docs[batch, q_idx] == docs[batch, kv_idx])

        # _compile: the eager builder launches hundreds of small kernels per call (measured 20 ms per
        # 0.5B step on an H200); compiled it is a few. Eager on CPU, where no compiler may be at hand.
        params.block_mask = create_block_mask(
            same_doc_causal, b, None, s, s, device=device, _compile=device.type == "cuda"
        )
    return params


_compiled_flex: Any = None


def _flex_attention(q: Tensor, k: Tensor, v: Tensor, block_mask: Any, scale: float, enable_gqa: bool) -> Tensor:
    """FlexAttention; compiled on CUDA (eager flex materialises the score matrix), eager on CPU. Inside
    an outer torch.compile region dynamo traces the call itself."""
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    fn = flex_attention
    if q.is_cuda and not torch.compiler.is_compiling():
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        fn = _compiled_flex
    return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)


def _varlen_attention(query: Tensor, key: Tensor, value: Tensor, params: DocumentPackedParams, scale: float) -> Tensor:
    """Flash varlen attention over the documents of the flattened rows; q [s, b, heads, d] in megatron's
    layout (GQA K/V not repeated), returns [s, b, heads, d]. With one row per micro batch the layout
    changes are views."""
    sq, b, heads, d = query.shape

    def flat(x: Tensor) -> Tensor:
        return x.transpose(0, 1).reshape(b * sq, x.size(2), x.size(3))

    # Inside a compiled layer the longest document would be a new constant (a recompile) per batch;
    # the row length bounds it, and the kernel's blocks past a document's end return at once.
    longest = sq if torch.compiler.is_compiling() else params.doc_max_seqlen
    out = _FlashVarlen.apply(flat(query), flat(key), flat(value), params.doc_cu_seqlens, longest, scale)
    return out.view(b, sq, heads, value.size(3)).transpose(0, 1)


def _flash_supports(query: Tensor) -> bool:
    return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and query.size(-1) <= 256


def init_core_attention(module: MegatronModule, config: TransformerConfig, layer_number: int,
                        attn_mask_type: AttnMaskType, attention_type: str, attention_dropout: Optional[float],
                        softmax_scale: Optional[float], k_channels: Optional[int], v_channels: Optional[int],
                        tp: int) -> None:
    """The fields megatron's DotProductAttention constructor sets, which every core attention of ours
    (SDPACoreAttention, ring_attention.RingCoreAttention) sets alike in its own constructor."""
    module.layer_number = max(1, layer_number)
    module.attn_mask_type = attn_mask_type
    module.attention_type = attention_type
    projection_size = (v_channels or config.kv_channels) * config.num_attention_heads
    module.hidden_size_per_partition = divide(projection_size, tp)
    # apply_query_key_layer_scaling divides the scale by the layer number and multiplies it back in
    # fp32 inside the softmax (an fp16 overflow guard): the net scale is the plain one.
    module.softmax_scale = (
        softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(k_channels or config.kv_channels)
    )
    module.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout


class SDPACoreAttention(MegatronModule):
    """Same constructor and forward as megatron-core's DotProductAttention (plugs into SelfAttention)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        softcap: Optional[float] = None,
    ):
        # k_channels / v_channels: MLA's query-key and value head sizes (they differ); the output is
        # heads * v_channels wide
        super().__init__(config=config)
        self.softcap = softcap
        if config.context_parallel_size != 1:
            raise ValueError("SDPACoreAttention attends over whole rows: at context_parallel_size > 1 our layer spec "
                             "uses trinity.models.ring_attention.RingCoreAttention")
        if config.softmax_type != "vanilla":
            raise ValueError(f"softmax_type={config.softmax_type!r} is not supported by SDPACoreAttention")
        # sliding window (Mistral, Gemma): a query sees itself and the `window` keys before it, in every kernel
        self.window = layer_window(config, layer_number)
        if self.window is not None and config.window_size[1] != 0:
            raise ValueError(f"window_size {config.window_size}: SDPACoreAttention attends causally (right 0)")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        tp = pg_collection.tp.size()
        init_core_attention(self, config, layer_number, attn_mask_type, attention_type, attention_dropout,
                            softmax_scale, k_channels, v_channels, tp)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by SDPACoreAttention")
        packed = packed_seq_params
        if packed is not None and not isinstance(packed, DocumentPackedParams):
            raise ValueError(THD_NEEDS_TE)
        kernel = None
        window = self.window
        if packed is not None and self.softcap is not None:
            attention_mask = packed.dense_mask()  # capped scores: the eager path, which the packed kernels lack
        elif packed is not None:
            # the varlen and flex boundaries are built once for every layer, without a window: a windowed
            # layer takes the documents kernel or the dense mask with the window added
            if window is not None:
                if packed.documents is not None:
                    kernel = "documents"
                else:
                    attention_mask = packed.dense_mask()
            # flash's kernel needs one head size for q/k and v (MLA's differ: flex or the mask then)
            elif packed.doc_cu_seqlens is not None and _flash_supports(query) and value.size(-1) == query.size(-1):
                kernel = "varlen"
            elif query.is_cuda and packed.block_mask is not None:
                kernel = "flex"
            elif packed.documents is not None:
                kernel = "documents"
            else:
                attention_mask = packed.dense_mask()
            if kernel in ("varlen", "flex") and self.training and self.dropout_p > 0.0:
                raise ValueError(f"document_packed_params ({kernel}) excludes attention dropout on CUDA")
        if kernel == "varlen":
            out = _varlen_attention(query, key, value, packed, self.softmax_scale)
            return out.reshape(query.size(0), query.size(1), self.hidden_size_per_partition)
        dropout_p = self.dropout_p if self.training else 0.0
        if kernel == "documents":
            docs = packed.documents
            if window is not None:  # padded queries keep their key (the document's first token): no empty row
                far = outside_window(docs.mask.size(-1), window, device=docs.mask.device) & docs.valid[:, None, :, None]
                docs = DocumentBatch(docs.index, docs.valid, docs.mask & ~far)
            return self._with_dropout_rng(dropout_p, lambda: _document_attention(
                query, key, value, docs, self.softmax_scale, dropout_p))
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        sq, b, heads, d = query.shape
        sk = key.size(0)
        q = query.permute(1, 2, 0, 3)  # [b, heads, sq, d]
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        is_causal = False
        mask = None
        if attention_mask is not None:
            mask = ~attention_mask  # SDPA: True = attend
        elif mask_type in _CAUSAL_TYPES:
            if sq == sk:
                is_causal = True  # fast path: no mask tensor, flash kernel on CUDA
            else:
                mask = ~causal_mask(sq, sk, device=query.device)
            if window is not None:
                mask = ~(causal_mask(sq, sk, device=query.device) | outside_window(sq, window, sk, device=query.device))
                is_causal = False
        if window is not None and attention_mask is not None:
            mask = mask & ~outside_window(sq, window, sk, device=query.device)
        # GQA without repeating K/V. With a mask too this stays on a fused kernel: on an H100 (torch
        # 2.11, s=4096, 28/4 heads, d=128, bf16) masked fwd+bwd took 2.89 ms with enable_gqa and
        # 2.98 ms with K/V repeated; causal without a mask 1.04 ms.
        enable_gqa = heads != k.size(1)
        if kernel == "flex":
            out = _flex_attention(q, k, v, packed.block_mask, self.softmax_scale, enable_gqa)
            return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)
        if self.softcap is not None:  # the eager path takes its causal mask explicitly
            if mask is None and is_causal:
                mask = ~causal_mask(sq, sk, device=query.device)
            out = self._with_dropout_rng(dropout_p, lambda: softcapped_attention(
                q, k, v, mask, self.softmax_scale, self.softcap, dropout_p))
            return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

        out = self._with_dropout_rng(dropout_p, lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
            scale=self.softmax_scale, enable_gqa=enable_gqa,
        ))
        # [b, heads, sq, d] -> [sq, b, heads*d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _with_dropout_rng(self, dropout_p: float, attend: Any) -> Tensor:
        """attend() with attention dropout drawn as DotProductAttention draws it: heads differ per TP rank,
        so dropout draws from the TP stream (not with sequence parallel, whose ranks hold all heads)."""
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return attend()
        return attend()


def _mla_self_attention() -> type:
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    class PackedMLASelfAttention(MLASelfAttention):
        """megatron-core's MLASelfAttention taking our sbhd document packing (`document_packed_params`).

        With packed_seq_params megatron's MLA assumes the thd layout and squeezes dim 1 of the latents (the
        batch of a [t, 1, h] tensor): our packed rows are [s, b, h], so a one-row micro batch lost its batch
        dimension (RL packs one row). For sbhd the projections and RoPE are those of unpacked rows (RoPE
        depends on distance only), so they run without it; core attention still gets it from forward."""

        def get_query_key_value_tensors(self, hidden_states, key_value_states=None, position_ids=None,
                                        packed_seq_params=None, inference_context=None, **kwargs):
            if packed_seq_params is not None and packed_seq_params.qkv_format == "sbhd":
                packed_seq_params = None
            return super().get_query_key_value_tensors(hidden_states, key_value_states, position_ids,
                                                       packed_seq_params, inference_context, **kwargs)

    return PackedMLASelfAttention


_MLA_CLASS: list[type] = []


def mla_self_attention() -> type:
    """The MLA attention class of our layer spec (built once: spec identity matters to megatron)."""
    if not _MLA_CLASS:
        _MLA_CLASS.append(_mla_self_attention())
    return _MLA_CLASS[0]
