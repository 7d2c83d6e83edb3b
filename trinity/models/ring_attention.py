"""Ring attention over the context-parallel group, without TransformerEngine.

With context parallelism each CP rank holds two chunks of every row, chunk r and chunk 2·CP-1-r of 2·CP
(megatron-core's load-balanced split, `trinity.distributed.context_parallel`). A query needs the keys and
values of every earlier position, so K/V travel around the ring: in step i rank r attends its queries to
the K/V block of rank r-i while passing the block on to rank r+1 (`collectives.ring_shift`, posted before
the step's compute so that the transfer overlaps it). Each step yields a partial output and its
log-sum-exp; the online-softmax rule merges them (the stable sigmoid form of torch's `_SDPAMerger`,
torch.distributed.tensor.experimental._context_parallel._attention, after
github.com/zhuzilin/ring-flash-attention/pull/34). The backward is a second ring: K/V travel again, and
with them an fp32 accumulator of their gradient that ends, after one more step, on the rank owning the
block. Per rank, memory holds its own q/k/v/output, one block in flight and one block's scores.

Which blocks a step computes, for rank r and source rank src = r - i (the split makes it whole blocks):
- src == r: both local chunks against both, causal (local order is position order);
- src < r: both query chunks against src's first chunk only, unmasked (its second chunk lies after both);
- src > r: the second query chunk only, against both of src's chunks, unmasked.
torch's `_templated_ring_attention` uses the same three cases for its round-robin load balance.

Packed rows (several documents per row) add a document mask per block from each token's document id:
`ring_document_params(doc_ids)` carries the whole rows' ids, so a rank finds the ids of any source
block's positions without sending them. Blocks with a document mask, fp32 blocks and CPU blocks compute
the scores explicitly (`_MathBlock`, fp32 softmax); bf16/fp16 blocks without one run torch's flash kernel
(`_FlashBlock`, `aten._flash_attention_forward`/`_backward`: these return and take the log-sum-exp, which
`F.scaled_dot_product_attention` does not expose). GQA: K/V keep their groups in every kernel.

Conventions are megatron's, as SDPACoreAttention's: q [s, b, heads, d], k/v [s, b, groups, d] (s: this
rank's 2 chunks), output [s, b, heads * d_v].

Memory per rank and layer call: its q/k/v/output, two K/V blocks (one computing, one arriving), in the
backward two fp32 gradient accumulators of K/V's size, and the kernel's own: flash's, or the math kernel's
fp32 score tiles of at most `SCORE_BYTES` (queries in tiles, so packed rows at long lengths fit; fp32
matmuls are several times slower than flash on GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from trinity.distributed import collectives
from trinity.distributed.context_parallel import chunk_positions
from trinity.models.attention import init_core_attention


@dataclass
class RingDocumentParams(PackedSeqParams):
    """Packed rows under context parallelism: `doc_ids` [b, s] are the whole rows' document ids (s is the
    row length before the CP split, as megatron sizes RoPE from `max_seqlen_q`), on the layers' device."""

    doc_ids: Optional[Tensor] = None


def ring_document_params(doc_ids: Tensor, *, device: torch.device | str | None = None) -> RingDocumentParams:
    """The packed-rows parameters of `RingCoreAttention` for whole rows' document ids [b, s] (not split)."""
    s = doc_ids.size(1)
    docs = doc_ids.to(device if device is not None else doc_ids.device, non_blocking=True).contiguous()
    return RingDocumentParams(qkv_format="sbhd", max_seqlen_q=s, max_seqlen_kv=s, doc_ids=docs)


# --- one block: partial output and log-sum-exp, and the gradient given the final ones -----------------------
# Layout inside the ring: q [b, sq, heads, d], k/v [b, sk, groups, d]; lse [b, heads, sq] fp32.


SCORE_BYTES = 256 << 20
"""The math kernel's budget for one fp32 score tile ([b, heads, rows, keys]): queries go through it in
tiles of as many rows as fit, so its memory does not grow with the square of the block."""


class _MathBlock:
    """Scores computed explicitly in fp32, any boolean mask (True = attend) broadcastable to [b, sq, sk],
    queries in tiles of `rows`. A query with no key to attend in the block gets output 0 and log-sum-exp
    -inf (adds nothing when merged)."""

    @staticmethod
    def rows(q: Tensor, k: Tensor, budget: int) -> int:
        b, _, h, _ = q.shape
        return max(1, budget // (4 * b * h * k.size(1)))

    @staticmethod
    def _scores(q: Tensor, k: Tensor, scale: float, attend: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        b, sq, h, d = q.shape
        g = k.size(2)
        q5 = q.float().permute(0, 2, 1, 3).reshape(b, g, h // g, sq, d)  # head j uses group j // rep
        k5 = k.float().permute(0, 2, 1, 3).unsqueeze(2)  # [b, g, 1, sk, d]
        s = torch.matmul(q5, k5.transpose(-1, -2)) * scale
        if attend is not None:
            s = s.masked_fill(~attend.view(attend.size(0), 1, 1, sq, k.size(1)), float("-inf"))
        return s, q5

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, scale: float, attend: Optional[Tensor],
                budget: int = SCORE_BYTES) -> tuple[Tensor, Tensor]:
        rows = _MathBlock.rows(q, k, budget)
        outs, lses = [], []
        for r in range(0, q.size(1), rows):
            tile = slice(r, r + rows)
            o, lse = _MathBlock._forward(q[:, tile], k, v, scale, None if attend is None else attend[:, tile])
            outs.append(o)
            lses.append(lse)
        return torch.cat(outs, 1), torch.cat(lses, 2)

    @staticmethod
    def _forward(q: Tensor, k: Tensor, v: Tensor, scale: float, attend: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        b, sq, h, _ = q.shape
        s, _ = _MathBlock._scores(q, k, scale, attend)
        lse = torch.logsumexp(s, dim=-1, keepdim=True)  # [b, g, rep, sq, 1]
        p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0.0))
        v5 = v.float().permute(0, 2, 1, 3).unsqueeze(2)
        out = torch.matmul(p, v5)  # [b, g, rep, sq, dv]
        return out.reshape(b, h, sq, -1).transpose(1, 2), lse.reshape(b, h, sq)

    @staticmethod
    def backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                 attend: Optional[Tensor], budget: int = SCORE_BYTES) -> tuple[Tensor, Tensor, Tensor]:
        rows = _MathBlock.rows(q, k, budget)
        dqs, dk, dv = [], None, None
        for r in range(0, q.size(1), rows):
            tile = slice(r, r + rows)
            dq_t, dk_t, dv_t = _MathBlock._backward(dout[:, tile], q[:, tile], k, v, out[:, tile], lse[:, :, tile],
                                                    scale, None if attend is None else attend[:, tile])
            dqs.append(dq_t)
            dk, dv = (dk_t, dv_t) if dk is None else (dk + dk_t, dv + dv_t)
        return torch.cat(dqs, 1), dk, dv

    @staticmethod
    def _backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                  attend: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        b, sq, h, d = q.shape
        g = k.size(2)
        s, q5 = _MathBlock._scores(q, k, scale, attend)
        p = torch.exp(s - lse.reshape(b, g, h // g, sq, 1))  # the final lse: this block's share of the softmax

        def five(x: Tensor) -> Tensor:
            return x.float().permute(0, 2, 1, 3).reshape(b, g, h // g, sq, x.size(-1))

        do5, o5 = five(dout), five(out)
        k5 = k.float().permute(0, 2, 1, 3).unsqueeze(2)
        v5 = v.float().permute(0, 2, 1, 3).unsqueeze(2)
        dv = torch.matmul(p.transpose(-1, -2), do5).sum(2)  # [b, g, sk, dv]
        dp = torch.matmul(do5, v5.transpose(-1, -2))
        ds = p * (dp - (do5 * o5).sum(-1, keepdim=True))
        dq = torch.matmul(ds, k5) * scale  # [b, g, rep, sq, d]
        dk = torch.matmul(ds.transpose(-1, -2), q5).sum(2) * scale
        return dq.reshape(b, h, sq, d).transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


class _FlashBlock:
    """torch's flash kernel (CUDA, bf16/fp16, one head size for q/k and v): GQA and the causal triangle
    inside the kernel, log-sum-exp returned; the backward recomputes the block's probabilities from the
    final log-sum-exp and output, which is exactly its share of the whole row's gradient."""

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor, Any]:
        # cum_seq None: the batch (not varlen) kernel; the rng tensors go back to the backward as they came
        # (no dropout reads them), as trinity.models.attention._FlashVarlen passes them
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, None, None, q.size(1), k.size(1), 0.0, causal, False, scale=scale)
        return out, lse, (rng, unused)

    @staticmethod
    def backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                 causal: bool, state: Any) -> tuple[Tensor, Tensor, Tensor]:
        rng, unused = state
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), None, None, q.size(1), k.size(1),
            0.0, causal, rng, unused, scale=scale)
        return dq, dk, dv


def flash_supported(q: Tensor, v: Tensor) -> bool:
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.size(-1) <= 256
            and q.size(-1) % 8 == 0 and v.size(-1) == q.size(-1)
            and hasattr(torch.ops.aten, "_flash_attention_forward"))


# --- the ring ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Step:
    q: slice  # local query rows
    k: slice  # rows of the source block
    causal: bool


def _plan(rank: int, src: int, chunk: int) -> _Step:
    everything = slice(0, 2 * chunk)
    if src == rank:
        return _Step(everything, everything, True)
    if src < rank:
        return _Step(everything, slice(0, chunk), False)
    return _Step(slice(chunk, 2 * chunk), everything, False)


class _Ring:
    """One attention call's ring: the group, this rank's place, the kernel and the documents."""

    def __init__(self, group: Any, scale: float, doc_ids: Optional[Tensor], use_flash: bool, local_len: int,
                 score_bytes: int = SCORE_BYTES):
        self.group = group
        self.score_bytes = score_bytes
        self.n = collectives.size(group)
        self.rank = collectives.rank(group)
        self.scale = scale
        self.chunk = local_len // 2
        self.doc_ids = doc_ids
        self.use_flash = use_flash and doc_ids is None
        if doc_ids is not None:
            seq = doc_ids.size(1)
            if seq != 2 * self.chunk * self.n:
                raise ValueError(f"document ids cover {seq} tokens, the ring {self.n} x {2 * self.chunk}")
            self._docs = [doc_ids[:, chunk_positions(seq, self.n, r, device=doc_ids.device)] for r in range(self.n)]

    def attend(self, src: int, step: _Step, device: torch.device) -> Optional[Tensor]:
        """[b|1, sq, sk] boolean (True = attend) for the math kernel; None: every key."""
        mask = None
        if step.causal:
            n = 2 * self.chunk
            mask = torch.ones(n, n, dtype=torch.bool, device=device).tril().unsqueeze(0)
        if self.doc_ids is not None:
            same = self._docs[self.rank][:, step.q].unsqueeze(2) == self._docs[src][:, step.k].unsqueeze(1)
            mask = same if mask is None else same & mask
        return mask

    def block_forward(self, q: Tensor, k: Tensor, v: Tensor, src: int, step: _Step) -> tuple[Tensor, Tensor, Any]:
        """(partial output, log-sum-exp, what the kernel's backward needs of this call)"""
        q, k, v = q[:, step.q], k[:, step.k], v[:, step.k]
        if self.use_flash:
            return _FlashBlock.forward(q.contiguous(), k.contiguous(), v.contiguous(), self.scale, step.causal)
        return (*_MathBlock.forward(q, k, v, self.scale, self.attend(src, step, q.device), self.score_bytes), None)

    def block_backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, src: int,
                       step: _Step, state: Any) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v, dout, out = q[:, step.q], k[:, step.k], v[:, step.k], dout[:, step.q], out[:, step.q]
        lse = lse[:, :, step.q]
        if self.use_flash:
            return _FlashBlock.backward(dout, q.contiguous(), k.contiguous(), v.contiguous(), out, lse, self.scale,
                                        step.causal, state)
        return _MathBlock.backward(dout, q, k, v, out, lse, self.scale, self.attend(src, step, q.device),
                                   self.score_bytes)


_KV_TAG, _GRAD_TAG = 0, 1


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, ring: _Ring) -> Tensor:  # type: ignore[override]
        b, sq, h, _ = q.shape
        out = torch.zeros(b, sq, h, v.size(-1), dtype=torch.float32, device=q.device)
        lse = torch.full((b, h, sq), float("-inf"), dtype=torch.float32, device=q.device)
        kv = [k, v]
        states = []
        for i in range(ring.n):
            moving = collectives.ring_shift(kv, ring.group, tag=_KV_TAG) if i < ring.n - 1 else None
            src = (ring.rank - i) % ring.n
            step = _plan(ring.rank, src, ring.chunk)
            block_out, block_lse, state = ring.block_forward(q, kv[0], kv[1], src, step)
            states.append(state)
            old_out, old_lse = out[:, step.q], lse[:, :, step.q]
            new_lse = torch.logaddexp(old_lse, block_lse.float())
            # the first step (src == r) leaves every query a key (itself), so new_lse is finite from there on
            w_old = torch.exp(old_lse - new_lse).transpose(1, 2).unsqueeze(-1)
            w_new = torch.exp(block_lse.float() - new_lse).transpose(1, 2).unsqueeze(-1)
            out[:, step.q] = old_out * w_old + block_out.float() * w_new
            lse[:, :, step.q] = new_lse
            if moving is not None:
                kv = moving.wait()
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.ring, ctx.states = ring, states
        return result

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dout: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        ring: _Ring = ctx.ring
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv = [k, v]
        grads: Optional[collectives.RingShift] = None
        for i in range(ring.n):
            moving = collectives.ring_shift(kv, ring.group, tag=_KV_TAG) if i < ring.n - 1 else None
            src = (ring.rank - i) % ring.n
            step = _plan(ring.rank, src, ring.chunk)
            dq_b, dk_b, dv_b = ring.block_backward(dout, q, kv[0], kv[1], out, lse, src, step, ctx.states[i])
            dq[:, step.q] += dq_b.float()
            if grads is None:  # step 0: our own block's accumulator starts here
                dk_acc = torch.zeros_like(k, dtype=torch.float32)
                dv_acc = torch.zeros_like(v, dtype=torch.float32)
            else:  # the accumulator of block src, from the rank before us
                dk_acc, dv_acc = grads.wait()
            dk_acc[:, step.k] += dk_b.float()
            dv_acc[:, step.k] += dv_b.float()
            grads = collectives.ring_shift([dk_acc, dv_acc], ring.group, tag=_GRAD_TAG)
            if moving is not None:
                kv = moving.wait()
        dk, dv = grads.wait()  # our own block's, complete after its tour
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group: Any, *, scale: float,
                   doc_ids: Optional[Tensor] = None, use_flash: Optional[bool] = None,
                   score_bytes: int = SCORE_BYTES) -> Tensor:
    """Causal attention of this CP rank's queries over the whole rows, in the ring layout: q [b, s, heads, d],
    k/v [b, s, groups, d], s = this rank's two chunks; `doc_ids` [b, s * CP] the whole rows' document ids
    (None: one document per row). Returns [b, s, heads, d_v]. `use_flash` None: where `flash_supported`;
    `score_bytes`: the math kernel's score tile budget (`SCORE_BYTES`)."""
    if q.size(1) % 2:
        raise ValueError(f"ring attention: a rank holds two equal chunks, got {q.size(1)} tokens")
    if use_flash is None:
        use_flash = flash_supported(q, v)
    ring = _Ring(group, scale, doc_ids, use_flash, q.size(1), score_bytes)
    return _RingAttention.apply(q, k, v, ring)


class RingCoreAttention(MegatronModule):
    """Core attention for context parallelism without TransformerEngine: SDPACoreAttention's constructor and
    forward (plugs into megatron's SelfAttention through our layer spec), attention by `ring_attention` over
    the CP group. Packed rows take `ring_document_params`."""

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
        super().__init__(config=config)
        if softcap is not None:
            raise ValueError("RingCoreAttention does not cap scores (Gemma 2's softcap): CP needs softcap off")
        if config.window_size is not None:
            raise ValueError("RingCoreAttention has no sliding window: CP needs window_size None")
        if config.softmax_type != "vanilla":
            raise ValueError(f"softmax_type={config.softmax_type!r} is not supported by RingCoreAttention")
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"RingCoreAttention attends causally, not {attn_mask_type}")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        cp = getattr(pg_collection, "cp", None)
        self.cp_group = cp if cp is not None else parallel_state.get_context_parallel_group()
        tp = pg_collection.tp.size()
        init_core_attention(self, config, layer_number, attn_mask_type, attention_type, attention_dropout,
                            softmax_scale, k_channels, v_channels, tp)

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
        if attention_bias is not None or attention_mask is not None:
            raise ValueError("RingCoreAttention takes no attention mask or bias: packed rows pass "
                             "ring_document_params(doc_ids) as packed_seq_params")
        if self.training and self.dropout_p > 0.0:
            raise ValueError("RingCoreAttention has no attention dropout: set attention_dropout 0 with CP")
        doc_ids = None
        if packed_seq_params is not None:
            if not isinstance(packed_seq_params, RingDocumentParams):
                raise ValueError("context parallelism takes packed rows as ring_document_params(doc_ids), "
                                 f"not {type(packed_seq_params).__name__}")
            doc_ids = packed_seq_params.doc_ids
        sq, b = query.size(0), query.size(1)
        out = ring_attention(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), self.cp_group,
                             scale=self.softmax_scale, doc_ids=doc_ids)
        return out.transpose(0, 1).reshape(sq, b, self.hidden_size_per_partition)


__all__ = ["RingCoreAttention", "RingDocumentParams", "flash_supported", "ring_attention", "ring_document_params"]
