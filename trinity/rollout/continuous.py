"""The continuous-batching rollout engine: a pool of KV-cache slots sized from a memory budget.

Why: the static path (`trinity.rollout.generate.generate`) decodes every row of a rollout as one batch
until its longest row ends, over a cache of the final length, with no memory bound. Here:
- the KV cache is a pool of `slots` rows of `cache_len` tokens per layer of this pipeline stage, with
  `slots = min(max_num_seqs, budget // bytes per slot, rows)`; the budget is `kv_cache_memory_gib`, else
  `gpu_memory_utilization` x the memory free when the rollout starts (host memory on CPU);
- a row that ends (EOS or `max_new_tokens`) frees its slot; waiting rows are prefilled into free slots
  (a rollout larger than the pool runs in waves, each row's tokens unchanged);
- identical prompts (a prompt's n samples) are prefilled ONCE per admission and their keys/values copied
  to each sample's slot;
- every slot has its own position: a row's tokens sit at positions 0.. of its slot (no left padding), so
  RoPE and the causal mask are those of the row alone. A decode step runs the slots [0, b) with b the
  batch bucket above the highest live slot, attending over the first `L` cache positions, L the longest
  live context rounded up to `_LEN_BUCKET` (a step reads the live context, not the whole cache); keys
  after a row's position are masked. When no rows wait, live slots are compacted to the front so that
  the tail of a rollout runs small buckets.
- on CUDA (TP=1, dense MLPs) a decode step is one CUDA graph per (batch bucket, length bucket),
  captured at first use within a `generate` call (see `SlotDecoder`).

Sampling (temperature / top-k / top-p), EOS handling, the returned `Rollout` layout and log-probs are
those of `trinity.rollout.generate` (same `sample`, log p under the temperature-1 distribution).
Tensor parallelism: TP rank 0's samples are broadcast to its group. Pipeline parallelism: each stage
keeps its own layers' KV cache, hidden states go stage to stage (`_Pipeline`), the last stage samples
and broadcasts the tokens every step; every rank derives "which rows ended" from those tokens with the
same rule, so all ranks of a model-parallel group make the same scheduling decisions (the slot count
is the minimum over the group). Virtual pipeline stages (VPP): a rank holds several model chunks, each
with its own `SlotDecoder` (its layers' KV cache) sharing one slot state (tokens, positions, ended
flags); every prefill and decode step runs the chunks in order, hidden states going around the ring of
stages between them (`_Pipeline`). On CUDA "which rows ended" is read one step late (the host does not
wait for each step); a row that ended keeps a slot one extra step, computing nothing that is kept.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from trinity.errors import UserError
from trinity.models import lora  # the lean path's linears: base weight + active LoRA adapter
from trinity.rollout.types import Rollout, SamplingParams

_LEN_BUCKET = 256  # attention reads the cache up to the longest live context rounded up to this
_CACHE_MULTIPLE = 64
_PREFILL_TOKENS = 16384  # padded prompt tokens per prefill forward (bounds its activations)
DEFAULT_GPU_MEMORY_UTILIZATION = 0.8


@dataclass(frozen=True)
class KVBudget:
    """How many sequences the engine decodes at once (`actor_rollout_ref.rollout`'s fields of the same
    names). kv_cache_memory_gib wins over gpu_memory_utilization (the config refuses both set)."""

    max_num_seqs: int = 1024
    gpu_memory_utilization: float | None = None
    kv_cache_memory_gib: float | None = None

    @classmethod
    def from_config(cls, rollout: Any) -> "KVBudget":
        """From `actor_rollout_ref.rollout` (a RolloutConfig)."""
        return cls(rollout.max_num_seqs, rollout.gpu_memory_utilization, rollout.kv_cache_memory_gib)

    def budget_bytes(self, device: torch.device) -> tuple[int, str]:
        if self.kv_cache_memory_gib is not None:
            return int(self.kv_cache_memory_gib * 2**30), "kv_cache_memory_gib"
        util = DEFAULT_GPU_MEMORY_UTILIZATION if self.gpu_memory_utilization is None else self.gpu_memory_utilization
        return int(util * free_memory(device)), "gpu_memory_utilization"


def free_memory(device: torch.device) -> int:
    """Bytes the KV cache could take now: free device memory plus what torch's allocator holds unused
    (CUDA); available host memory (CPU)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _bucket(n: int, cap: int) -> int:
    """Batch bucket: powers of two up to 64, then multiples of 64 (few CUDA graphs, < 2x padding)."""
    b = 1
    while b < n and b < 64:
        b *= 2
    if b < n:
        b = -(-n // 64) * 64
    return min(b, cap)


class SlotDecoder:
    """Prefill and decode steps of one pipeline stage of a megatron GPTModel over a pool of KV slots
    [slots, groups, cache_len, head_dim] per layer, each slot at its own position.

    Layers run as `trinity.rollout.decode.StaticDecoder` runs them (the lean path at TP=1 with dense
    SwiGLU MLPs and torch RMSNorms, megatron's submodules otherwise), with per-row RoPE positions.
    The decode step reads its inputs from static buffers (`tok`, `pos`, `hidden`), so on CUDA (TP=1,
    dense) each (batch bucket, length bucket) is captured once as a CUDA graph and replayed.

    state_from: another chunk's decoder of the same rank (VPP) whose slot state (`tok`, `pos`, `done`)
    this one reads, so that the caller sets them once for all chunks."""

    def __init__(self, gpt: Any, slots: int, cache_len: int, *, cuda_graphs: bool = True,
                 state_from: "SlotDecoder | None" = None) -> None:
        from megatron.core import parallel_state as ps

        from trinity.rollout.decode import _lean_supported

        self.gpt, self.config = gpt, gpt.config
        self.layers = list(gpt.decoder.layers)
        first = self.layers[0].self_attention
        self.heads = first.num_attention_heads_per_partition
        self.groups, self.head_dim = first.num_query_groups_per_partition, first.hidden_size_per_attention_head
        param = next(gpt.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.slots, self.cache_len = slots, cache_len
        shape = (slots, self.groups, cache_len, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.freqs = gpt.rotary_pos_emb(cache_len)  # [cache_len, 1, 1, rot]: megatron's table, by position
        rot = self.freqs.shape[-1]
        self.cos = torch.cos(self.freqs).to(self.dtype).view(cache_len, rot)
        self.sin = torch.sin(self.freqs).to(self.dtype).view(cache_len, rot)
        self.scale = self.config.softmax_scale or self.head_dim**-0.5
        self.lean = _lean_supported(gpt)
        dense = all(not hasattr(layer.mlp, "router") for layer in self.layers)
        self.use_graph = cuda_graphs and self.device.type == "cuda" and ps.get_tensor_model_parallel_world_size() == 1 and dense
        self.first, self.last = gpt.pre_process, gpt.post_process
        # the decode step's static inputs: token and position of every slot, the previous stage's hidden
        self.owns_state = state_from is None
        self.tok = torch.zeros(slots, dtype=torch.long, device=self.device) if state_from is None else state_from.tok
        self.pos = torch.zeros(slots, dtype=torch.long, device=self.device) if state_from is None else state_from.pos
        self.hidden = None if self.first else torch.zeros(1, slots, self.config.hidden_size, dtype=self.dtype, device=self.device)
        # rows whose sequence ended (or that hold none): the split-KV kernel reads one key for them
        self.done = torch.ones(slots, dtype=torch.bool, device=self.device) if state_from is None else state_from.done
        self.rows = torch.arange(slots, device=self.device)
        self.kpos = torch.arange(cache_len, device=self.device)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.use_graph else None
        self.captures, self.capture_s = 0, 0.0
        from trinity.rollout import decode_attention

        self.split_kv = decode_attention.available(self.device, self.head_dim, self.heads // self.groups, self.dtype)
        self.attention = "triton split-KV" if self.split_kv else "sdpa"
        from trinity.rollout import decode_fused

        # RoPE + cache store and SwiGLU as one kernel each (lean layers; Qwen3's q/k norms keep the torch ops)
        self.fused = self.lean and not self.config.qk_layernorm and decode_fused.available(
            self.device, self.head_dim, self.heads // self.groups, rot, self.dtype)
        if self.fused:
            self.attention += " + fused RoPE/SwiGLU"

    # ---- layers ------------------------------------------------------------------------------------
    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos.index_select(0, positions.reshape(-1)), self.sin.index_select(0, positions.reshape(-1))

    def _attend_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of right-padded prompts: q [b, heads, s, d], k/v [b, groups, s, d]."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)

    def _store_prefill(self, i: int, k: torch.Tensor, v: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy prefill rows `src` of k/v [b, groups, s, d] into slots `dst` (a prompt's n samples share it)."""
        s = k.shape[2]
        self.keys[i][dst, :, :s] = k.index_select(0, src)
        self.values[i][dst, :, :s] = v.index_select(0, src)

    def _attend_decode(self, i: int, q: torch.Tensor, ctx: dict) -> torch.Tensor:
        """One query per row, a group's heads stacked: q [b, g, per, d] against the row's keys 0..pos."""
        b, L = q.shape[0], ctx["L"]
        if self.split_kv:
            from trinity.rollout.decode_attention import decode_attention

            return decode_attention(q, self.keys[i], self.values[i], ctx["nkeys"], L, self.scale)
        return F.scaled_dot_product_attention(q, self.keys[i][:b, :, :L], self.values[i][:b, :, :L],
                                              attn_mask=ctx["bias"], scale=self.scale)

    def _lean_layer(self, i: int, layer: Any, x: torch.Tensor, s: int, b: int, cos: torch.Tensor, sin: torch.Tensor,
                    ctx: dict) -> torch.Tensor:
        from trinity.rollout.decode import _rms, _rope

        attn, mlp = layer.self_attention, layer.mlp
        g, per, d = self.groups, self.heads // self.groups, self.head_dim
        qkv = lora.linear(_rms(x, layer.input_layernorm), attn.linear_qkv, attn.linear_qkv.bias)
        qkv = qkv.view(s, b, g, per + 2, d)
        if ctx["decode"] and self.fused:
            from trinity.rollout.decode_fused import rope_store

            q = rope_store(qkv[0], self.cos, self.sin, self.pos[:b], self.keys[i], self.values[i])
            out = self._attend_decode(i, q, ctx).reshape(b, g * per * d)
            return self._lean_rest(layer, x, out)
        if self.config.qk_layernorm:
            q = _rope(_rms(qkv[:, :, :, :per], attn.q_layernorm), cos, sin)
            k = _rope(_rms(qkv[:, :, :, per:per + 1], attn.k_layernorm), cos, sin)
        else:
            qk = _rope(qkv[:, :, :, :per + 1], cos, sin)
            q, k = qk[:, :, :, :per], qk[:, :, :, per:]
        v = qkv[:, :, :, per + 1]
        if ctx["decode"]:
            # s == 1: write this step's key/value at each row's own position, then attend over the first
            # L positions with the group's query heads stacked along the query axis (no repeated K/V)
            self.keys[i][self.rows[:b], :, self.pos[:b]] = k[0, :, :, 0]
            self.values[i][self.rows[:b], :, self.pos[:b]] = v[0]
            out = self._attend_decode(i, q[0], ctx).reshape(b, g * per * d)  # q [b, g, per, d]
        else:
            kk, vv = k.squeeze(3).permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)  # [b, g, s, d]
            self._store_prefill(i, kk, vv, ctx["src"], ctx["dst"])
            qq = q.permute(1, 2, 3, 0, 4).reshape(b, g * per, s, d)
            out = self._attend_prefill(qq, kk, vv).permute(2, 0, 1, 3).reshape(s * b, g * per * d)
        return self._lean_rest(layer, x, out)

    def _lean_rest(self, layer: Any, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """A lean layer after its attention: output projection + residual, then the SwiGLU MLP + residual."""
        from trinity.rollout.decode import _rms

        attn, mlp = layer.self_attention, layer.mlp
        x = lora.addmm(x, out, attn.linear_proj)
        if attn.linear_proj.bias is not None:
            x = x + attn.linear_proj.bias
        up = lora.linear(_rms(x, layer.pre_mlp_layernorm), mlp.linear_fc1)
        if self.fused:
            from trinity.rollout.decode_fused import silu_mul

            act = silu_mul(up)
        else:
            gate, value = torch.chunk(up, 2, dim=-1)
            act = F.silu(gate) * value
        return lora.addmm(x, act, mlp.linear_fc2)

    def _module_attention(self, i: int, layer: Any, hidden: torch.Tensor, freqs: torch.Tensor, ctx: dict) -> torch.Tensor:
        from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

        attn = layer.self_attention
        q, k, v = attn.get_query_key_value_tensors(hidden, None)  # [s, b, heads|groups, d]
        q = apply_rotary_pos_emb(q, freqs, config=self.config)
        k = apply_rotary_pos_emb(k, freqs, config=self.config)
        s, b = hidden.shape[:2]
        if ctx["decode"]:
            self.keys[i][self.rows[:b], :, self.pos[:b]] = k[0]
            self.values[i][self.rows[:b], :, self.pos[:b]] = v[0]
            per = self.heads // self.groups
            out = self._attend_decode(i, q[0].reshape(b, self.groups, per, self.head_dim), ctx)
            out = out.reshape(b, self.heads, 1, self.head_dim)
        else:
            kk, vv = k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)
            self._store_prefill(i, kk, vv, ctx["src"], ctx["dst"])
            out = self._attend_prefill(q.permute(1, 2, 0, 3), kk, vv)
        out, bias = attn.linear_proj(out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.head_dim))
        return out if bias is None else out + bias

    def _layers(self, x: torch.Tensor, positions: torch.Tensor, ctx: dict) -> torch.Tensor:
        """x [s, b, h]; positions [s, b] (RoPE)."""
        s, b, h = x.shape
        if self.lean:
            cos, sin = self._rope_tables(positions)
            cos, sin = cos.view(s, b, 1, 1, -1), sin.view(s, b, 1, 1, -1)
            x = x.reshape(s * b, h)
            for i, layer in enumerate(self.layers):
                x = self._lean_layer(i, layer, x, s, b, cos, sin, ctx)
            return x.view(s, b, h)
        freqs = self.freqs.index_select(0, positions.reshape(-1)).view(s, b, 1, -1)
        for i, layer in enumerate(self.layers):
            x = x + self._module_attention(i, layer, layer.input_layernorm(x), freqs, ctx)
            out, bias = layer.mlp(layer.pre_mlp_layernorm(x))
            x = x + (out if bias is None else out + bias)
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [1, b, h] -> logits [b, vocab (gathered over TP, padded)]."""
        x = self.gpt.decoder.final_layernorm(x)
        weight = self.gpt.shared_embedding_or_output_weight() if self.gpt.share_embeddings_and_output_weights else None
        logits, _ = self.gpt.output_layer(x, weight=weight, runtime_gather_output=True)
        return logits[0]

    # ---- prefill -----------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                hidden: torch.Tensor | None) -> torch.Tensor:
        """Right-padded prompts tokens [u, s] (lengths [u]) at positions 0..s-1; prompt src[j]'s keys and
        values go to slot dst[j]. Returns each prompt's last-token logits [u, vocab] (last stage) or the
        hidden states [s, u, h] to send on."""
        u, s = tokens.shape
        positions = torch.arange(s, device=self.device).view(s, 1).expand(s, u)
        if self.first:
            x = self.gpt.embedding(input_ids=tokens, position_ids=positions.t())
        else:
            assert hidden is not None, "a non-first pipeline stage needs the previous stage's hidden states"
            x = hidden
        x = self._layers(x, positions, {"decode": False, "src": src, "dst": dst})
        if not self.last:
            return x
        last = x[lengths - 1, torch.arange(u, device=self.device)].unsqueeze(0)  # [1, u, h]
        return self._logits(last)

    # ---- decode ------------------------------------------------------------------------------------
    def _step(self, b: int, L: int) -> torch.Tensor:
        pos = self.pos[:b]
        # additive mask: a row attends to its positions 0..pos (written by its prefill and earlier steps)
        bias = None if self.split_kv else torch.zeros(b, 1, 1, L, dtype=self.dtype, device=self.device).masked_fill_(
            (self.kpos[:L].view(1, 1, 1, L) > pos.view(b, 1, 1, 1)), float("-inf"))
        nkeys = torch.where(self.done[:b], torch.ones_like(pos), pos + 1) if self.split_kv else None
        ctx = {"decode": True, "L": L, "bias": bias, "nkeys": nkeys}
        x = self.gpt.embedding(input_ids=self.tok[:b].view(b, 1), position_ids=pos.view(b, 1)) if self.first else self.hidden[:, :b]
        x = self._layers(x, pos.view(1, b), ctx)
        return self._logits(x) if self.last else x

    @torch.no_grad()
    def step(self, b: int, L: int, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """One token for each of the slots [0, b) from `tok`/`pos` (set by the caller), attending over the
        first L positions; `hidden` [1, b, h] from the previous stage (non-first stages). Returns logits
        [b, vocab] (last stage) or hidden states [1, b, h] (a graph's output buffer: valid until the
        next step)."""
        if self.hidden is not None:
            assert hidden is not None, "a non-first pipeline stage needs the previous stage's hidden state"
            self.hidden[:, :b].copy_(hidden)
        if not self.use_graph:
            return self._step(b, L)
        key = (b, L)
        if key not in self._graphs:
            self._capture(key)
        graph, out = self._graphs[key]
        graph.replay()
        return out

    def _capture(self, key: tuple[int, int]) -> None:
        # A warm-up run on a side stream (lazy inits, cuBLAS workspaces) before capture, as torch advises.
        # Its cache writes are those the replay below makes again (same tokens at the same positions).
        start = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._step(*key)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._step(*key)
        self._graphs[key] = (graph, out)
        torch.cuda.synchronize()
        self.captures += 1
        self.capture_s += time.perf_counter() - start

    def close(self) -> None:
        """Drop the KV cache and the graphs now: `generate_continuous`'s nested functions reference this
        decoder in a reference cycle, which only the garbage collector would break, late."""
        self.keys, self.values = [], []
        self._graphs.clear()

    @torch.no_grad()
    def move(self, src: list[int], dst: list[int]) -> None:
        """Move the KV cache rows of slots `src` to slots `dst` (compaction)."""
        s = torch.tensor(src, device=self.device)
        d = torch.tensor(dst, device=self.device)
        for cache in (*self.keys, *self.values):
            cache.index_copy_(0, d, cache.index_select(0, s))
        for buf in (self.tok, self.pos) if self.owns_state else ():
            buf.index_copy_(0, d, buf.index_select(0, s))


@dataclass
class RolloutStats:
    """What the last `generate` call did (benchmarks/rl_step.py and the tests read it)."""

    rows: int = 0
    slots: int = 0
    cache_len: int = 0
    kv_bytes_per_token: int = 0
    prefill_calls: int = 0
    prefilled_prompts: int = 0
    decode_steps: int = 0
    live_kv_tokens: int = 0  # sum over decode steps of the live rows' context lengths (KV read floor)
    slot_steps: int = 0  # sum over decode steps of the batch bucket (rows computed, live or not)
    tokens: int = 0
    attention: str = ""  # the decode attention: "triton split-KV" (CUDA) or "sdpa"
    graph_captures: int = 0
    capture_s: float = 0.0
    waves: int = 0  # admissions

    @property
    def computed_tokens(self) -> int:
        """Tokens the engine computed: each row's first (from its prefill) and every decode step's batch
        bucket, rows that had ended or held nothing included."""
        return self.rows + self.slot_steps


class _DoneFlags:
    """The host's view of the slots' "ended" flags. On CPU it reads them at once; on CUDA it copies them
    to pinned memory without waiting and reads a copy one step later (that step has finished by then),
    so the host never waits for the step it just queued."""

    def __init__(self, device: torch.device, slots: int) -> None:
        self.lagged = device.type == "cuda"
        self.pending: tuple[int, torch.Tensor, Any] | None = None
        if self.lagged:
            self._bufs = [torch.zeros(slots, dtype=torch.bool, pin_memory=True) for _ in range(2)]
            self._turn = 0

    def record(self, it: int, done: torch.Tensor) -> tuple[int, torch.Tensor] | None:
        """Snapshot after iteration `it`'s step; returns a snapshot to act on (or None)."""
        if not self.lagged:
            return it, done.clone()
        buf = self._bufs[self._turn]
        self._turn ^= 1
        buf.copy_(done, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        previous, self.pending = self.pending, (it, buf, event)
        if previous is None:
            return None
        previous[2].synchronize()
        return previous[0], previous[1]

    def flush(self) -> tuple[int, torch.Tensor] | None:
        if self.pending is None:
            return None
        it, buf, event = self.pending
        self.pending = None
        event.synchronize()
        return it, buf


def _model_parallel_min(value: int, device: torch.device) -> int:
    """The smallest `value` over this rank's model-parallel group (TP x PP): its ranks must agree."""
    from megatron.core import parallel_state as ps

    if not torch.distributed.is_initialized() or ps.get_model_parallel_group() is None:
        return value
    group = ps.get_model_parallel_group()
    if torch.distributed.get_world_size(group) == 1:
        return value
    t = torch.tensor([value], dtype=torch.long, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=group)
    return int(t.item())


def kv_bytes_per_token(gpt: Any) -> int:
    """Bytes of keys and values one token takes in this stage's layers (this TP rank's heads); `gpt` may
    be the rank's list of model chunks (VPP)."""
    if isinstance(gpt, (list, tuple)):
        return sum(kv_bytes_per_token(g) for g in gpt)
    first = gpt.decoder.layers[0].self_attention
    elem = next(gpt.parameters()).element_size()
    return len(gpt.decoder.layers) * 2 * first.num_query_groups_per_partition * first.hidden_size_per_attention_head * elem


def plan_slots(gpt: Any, budget: KVBudget, rows: int, cache_len: int, device: torch.device) -> int:
    """Slots of the pool: max_num_seqs, the rows there are and what the KV budget holds, the same on
    every rank of the model-parallel group; a budget below one sequence is a UserError naming the key."""
    per_slot = kv_bytes_per_token(gpt) * cache_len
    nbytes, key = budget.budget_bytes(device)
    slots = _model_parallel_min(min(budget.max_num_seqs, rows, nbytes // per_slot), device)
    if slots < 1:
        raise UserError(
            f"actor_rollout_ref.rollout.{key}: the KV cache budget ({nbytes / 2**30:.3g} GiB) holds no sequence: one "
            f"sequence of {cache_len} tokens (longest prompt + response_length) needs {per_slot / 2**30:.3g} GiB; "
            f"raise {key} or lower data.max_prompt_length / actor_rollout_ref.rollout.response_length")
    return slots


@torch.no_grad()
def generate_continuous(
    model: Any,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    vocab_size: int,
    pad_id: int,
    budget: KVBudget = KVBudget(),
    generator: torch.Generator | None = None,
    cuda_graphs: bool = True,
    response_lengths: Sequence[int] | None = None,
    stats: RolloutStats | None = None,
) -> Rollout:
    """Sample responses for `prompts` with a megatron GPTModel (or its DDP wrapper) through a slot pool
    (module doc); with virtual pipeline stages `model` is the rank's list of model chunks (in order). Every rank of a model-parallel group calls it with the same prompts and gets the same
    `Rollout` (left-padded prompts, right-padded responses, as `trinity.rollout.generate.generate`).

    response_lengths: benchmark-only: row i also ends after response_lengths[i] tokens (a schedule of
    "EOS" positions for random-weight models that never emit one)."""
    from trinity.models.build import unwrap
    from trinity.rollout.generate import _Pipeline, _tp_broadcast, left_pad, sample

    gpts = [unwrap(m) for m in (model if isinstance(model, (list, tuple)) else [model])]
    param = next(gpts[0].parameters())
    device = param.device
    stats = stats if stats is not None else RolloutStats()
    rows = len(prompts)
    max_new = params.max_new_tokens
    plens = [len(p) for p in prompts]
    if rows == 0 or min(plens) == 0:
        raise ValueError("generate_continuous: every prompt needs at least one token")
    cache_len = -(-(max(plens) + max_new) // _CACHE_MULTIPLE) * _CACHE_MULTIPLE
    slots = plan_slots(gpts, budget, rows, cache_len, device)
    pipe = _Pipeline(gpts, device, param.dtype)
    # one decoder per model chunk; `dec` (chunk 0) holds the slot state all of them read
    dec = SlotDecoder(gpts[0], slots, cache_len, cuda_graphs=cuda_graphs)
    decs = [dec] + [SlotDecoder(g, slots, cache_len, cuda_graphs=cuda_graphs, state_from=dec) for g in gpts[1:]]
    stats.rows, stats.slots, stats.cache_len, stats.kv_bytes_per_token = rows, slots, cache_len, kv_bytes_per_token(gpts)
    eos = torch.tensor(sorted(set(params.eos_token_ids)) or [-1], device=device)

    # outputs: one extra row (`rows`) takes the writes of slots that hold no live row
    out_tokens = torch.full((rows + 1, max_new), pad_id, dtype=torch.long, device=device)
    out_logp = torch.zeros((rows + 1, max_new), dtype=torch.float32, device=device)
    out_len = torch.zeros(rows + 1, dtype=torch.long, device=device)
    limit = torch.full((rows + 1,), max_new, dtype=torch.long, device=device)
    if response_lengths is not None:
        limit[:rows] = torch.tensor([max(1, min(max_new, int(n))) for n in response_lengths], device=device)
    # per slot: its output row, tokens generated so far, whether its row has ended
    row_of = torch.full((slots,), rows, dtype=torch.long, device=device)
    count = torch.zeros(slots, dtype=torch.long, device=device)
    done = dec.done

    # the waiting rows, grouped by prompt (a prompt's samples are prefilled once when admitted together)
    groups: dict[tuple[int, ...], list[int]] = {}
    for r, p in enumerate(prompts):
        groups.setdefault(tuple(p), []).append(r)
    waiting: list[list[int]] = list(groups.values())
    n_waiting = rows
    free = list(range(slots))  # kept sorted: new rows take the lowest slots
    slot_row = [-1] * slots  # host view: the row a slot holds (-1 = free)
    slot_admit = [0] * slots  # iteration of admission (flags snapshotted before it do not apply)
    slot_pos = [0] * slots  # upper bound of the slot's next position (host's estimate for L)
    active_set: set[int] = set()  # slots holding a row that has not been retired
    flags = _DoneFlags(device, slots)
    was_training = [g.training for g in gpts]
    for g in gpts:
        g.eval()

    def record(idx: torch.Tensor, nxt: torch.Tensor, logp: torch.Tensor, live: torch.Tensor) -> None:
        """Book the sampled tokens of slots `idx` (live: the slot's row has not ended)."""
        r = torch.where(live, row_of[idx], torch.full_like(idx, rows))
        c = count[idx].clamp(max=max_new - 1)
        out_tokens.index_put_((r, c), torch.where(live, nxt, torch.full_like(nxt, pad_id)))
        out_logp.index_put_((r, c), torch.where(live, logp, torch.zeros_like(logp)))
        n = count[idx] + live.long()
        count[idx] = n
        out_len[r] = n
        done[idx] = done[idx] | (live & (torch.isin(nxt, eos) | (n >= limit[r])))
        dec.tok[idx] = torch.where(live, nxt, dec.tok[idx])

    def sample_broadcast(logits: torch.Tensor | None, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if pipe.last:
            last = logits[:, :vocab_size].float()
            nxt = _tp_broadcast(sample(last, params, generator).contiguous())
            logp = torch.log_softmax(last, -1).gather(-1, nxt.unsqueeze(-1)).squeeze(-1)
        else:
            nxt = torch.empty(n, dtype=torch.long, device=device)
            logp = torch.zeros(n, dtype=torch.float32, device=device)
        return pipe.from_last(nxt), logp

    def admit(it: int) -> None:
        take: list[tuple[tuple[int, ...], list[int]]] = []
        while waiting and free:
            group = waiting[0]
            if len(group) <= len(free):
                waiting.pop(0)
                part = group
            elif not take:  # a group larger than the free slots: split it (its rest is prefilled again later)
                part, waiting[0] = group[: len(free)], group[len(free):]
            else:
                break
            dst = [free.pop(0) for _ in part]
            active_set.update(dst)
            take.append((tuple(prompts[part[0]]), list(zip(part, dst))))
        stats.waves += 1
        # prefill the admitted prompts in chunks of at most _PREFILL_TOKENS padded tokens
        chunk: list[tuple[tuple[int, ...], list[tuple[int, int]]]] = []
        for item in sorted(take, key=lambda t: len(t[0])):
            width = max(len(item[0]), *(len(c[0]) for c in chunk)) if chunk else len(item[0])
            if chunk and width * (len(chunk) + 1) > _PREFILL_TOKENS:
                prefill(chunk, it)
                chunk = []
            chunk.append(item)
        if chunk:
            prefill(chunk, it)

    def prefill(chunk: list[tuple[tuple[int, ...], list[tuple[int, int]]]], it: int) -> None:
        nonlocal n_waiting
        u, width = len(chunk), max(len(c[0]) for c in chunk)
        tok = torch.full((u, width), pad_id, dtype=torch.long)
        for j, (p, _) in enumerate(chunk):
            tok[j, : len(p)] = torch.tensor(p, dtype=torch.long)
        lengths = torch.tensor([len(p) for p, _ in chunk], device=device)
        src_l = [j for j, (_, pairs) in enumerate(chunk) for _ in pairs]
        pairs = [pr for _, prs in chunk for pr in prs]
        src = torch.tensor(src_l, device=device)
        dst = torch.tensor([s for _, s in pairs], device=device)
        tok = tok.to(device)
        for v, d in enumerate(decs):
            out = d.prefill(tok, lengths, src, dst, pipe.recv(width, u, v))
            pipe.send(out, v)
        stats.prefill_calls += 1
        stats.prefilled_prompts += u
        row_of[dst] = torch.tensor([r for r, _ in pairs], device=device)
        count[dst] = 0
        done[dst] = False
        dec.pos[dst] = lengths.index_select(0, src)  # the first sampled token goes at position len(prompt)
        nxt, logp = sample_broadcast(out.index_select(0, src) if pipe.last else None, len(pairs))
        record(dst, nxt, logp, torch.ones_like(dst, dtype=torch.bool))
        for (r, s), j in zip(pairs, src_l):
            slot_row[s], slot_admit[s], slot_pos[s] = r, it, len(chunk[j][0])
            n_waiting -= 1

    def retire(snap: tuple[int, torch.Tensor] | None) -> None:
        if snap is None:
            return
        it, ended = snap
        flags_now = ended.tolist()  # one host read, not one per slot
        for s in list(active_set):
            if slot_admit[s] < it and flags_now[s]:
                slot_row[s] = -1
                active_set.discard(s)
                free.append(s)
        free.sort()

    def compact(it: int) -> None:
        """No rows wait: move the live slots above the bucket of the live count into lower free slots."""
        live = sorted(active_set)
        if not live or _bucket(live[-1] + 1, slots) <= _bucket(len(live), slots):
            return
        src = [s for s in live if s >= len(live)]
        dst = [s for s in free if s < len(live)][: len(src)]
        for d in decs:
            d.move(src, dst)
        sl, dl = torch.tensor(src, device=device), torch.tensor(dst, device=device)
        for buf in (row_of, count, done):
            buf.index_copy_(0, dl, buf.index_select(0, sl))
        done[sl] = True
        row_of[sl] = rows
        for s, d in zip(src, dst):
            slot_row[d], slot_admit[d], slot_pos[d] = slot_row[s], it, slot_pos[s]
            slot_row[s] = -1
            active_set.discard(s)
            active_set.add(d)
        free[:] = sorted(set(free) - set(dst) | set(src))

    it = 0
    try:
        while True:
            snap = None
            if active_set:
                active = sorted(active_set)
                b = _bucket(active[-1] + 1, slots)
                # SDPA reads all L keys of a row: L follows the longest live row; the split-KV kernel reads
                # each row's own keys whatever L is: one L, one graph per batch bucket
                L = cache_len if dec.split_kv else min(
                    cache_len, -(-(max(slot_pos[s] for s in active) + 1) // _LEN_BUCKET) * _LEN_BUCKET)
                live = ~done[:b]
                for v, d in enumerate(decs):
                    out = d.step(b, L, pipe.recv(1, b, v))
                    pipe.send(out, v)
                nxt, logp = sample_broadcast(out if pipe.last else None, b)
                idx = dec.rows[:b]
                record(idx, nxt, logp, live)
                dec.pos[:b] += live.long()
                live_ctx = 0
                for s in active:
                    slot_pos[s] = min(slot_pos[s] + 1, cache_len - 1)
                    live_ctx += slot_pos[s]
                stats.decode_steps += 1
                stats.slot_steps += b
                stats.live_kv_tokens += live_ctx
                snap = flags.record(it, done)
            else:
                snap = flags.flush()
            retire(snap)
            if n_waiting and free:
                threshold = min(n_waiting, max(len(waiting[0]), slots // 8))
                if len(free) >= threshold or len(free) == slots:
                    admit(it)
            elif not n_waiting and len(free) < slots:
                compact(it)
            if not n_waiting and len(free) == slots and flags.pending is None:
                break
            it += 1
    finally:
        for g, training in zip(gpts, was_training):
            g.train(training)
        for d in decs:
            d.close()
    stats.graph_captures, stats.capture_s = sum(d.captures for d in decs), sum(d.capture_s for d in decs)
    stats.attention = dec.attention
    lengths = out_len[:rows]
    width = int(lengths.max())
    stats.tokens = int(lengths.sum())
    tokens, prompt_mask = left_pad(prompts, pad_id, device)
    response_mask = (torch.arange(width, device=device).unsqueeze(0) < lengths.unsqueeze(1)).long()
    logprobs = pipe.from_last(out_logp[:rows, :width].contiguous())
    return Rollout(
        tokens=torch.cat([tokens, out_tokens[:rows, :width]], dim=1),
        prompt_mask=prompt_mask,
        response_mask=response_mask,
        logprobs=logprobs * response_mask,
    )


@dataclass
class ActorRollout:
    """The built-in `RolloutEngine`: `generate_continuous` over the actor's own model chunks (hybrid
    engine: no second copy of the weights, no weight sync); `stats` describes its last call."""

    model: Any
    vocab_size: int
    pad_id: int
    budget: KVBudget = KVBudget()
    stats: RolloutStats = field(default_factory=RolloutStats)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 generator: torch.Generator | None = None) -> Rollout:
        self.stats = RolloutStats()
        lengths = bench_response_lengths(len(prompts), params.max_new_tokens)
        return generate_continuous(self.model, prompts, params, vocab_size=self.vocab_size, pad_id=self.pad_id,
                                   budget=self.budget, generator=generator, response_lengths=lengths, stats=self.stats)


BENCH_LENGTHS_ENV = "TRINITY_BENCH_RESPONSE_LENGTHS"
_bench_calls = [0]


def bench_response_lengths(rows: int, max_new: int) -> list[int] | None:
    """Benchmark-only EOS schedule (benchmarks/rl_step.py --lengths): with TRINITY_BENCH_RESPONSE_LENGTHS
    set to `uniform` or `lognormal`, each row ends after a drawn number of tokens (see
    `draw_response_lengths`), seeded by the call count so that every rank of a job draws the same;
    `fixed` or unset: no schedule (rows end at EOS or max_new_tokens)."""
    kind = os.environ.get(BENCH_LENGTHS_ENV, "fixed")
    if kind == "fixed":
        return None
    _bench_calls[0] += 1
    return draw_response_lengths(kind, rows, max_new, seed=1000 + _bench_calls[0])


def draw_response_lengths(kind: str, rows: int, max_new: int, seed: int = 0) -> list[int]:
    """`rows` response lengths in 1..max_new: `fixed` (all max_new), `uniform`, or `lognormal` (sigma 1,
    mean 30% of max_new before clipping at max_new)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "fixed":
        return [max_new] * rows
    if kind == "uniform":
        return torch.randint(1, max_new + 1, (rows,), generator=g).tolist()
    if kind == "lognormal":
        sigma = 1.0
        mu = math.log(0.3 * max_new) - sigma**2 / 2  # E[X] = exp(mu + sigma^2 / 2) = 0.3 max_new
        x = torch.exp(mu + sigma * torch.randn(rows, generator=g))
        return x.round().clamp(1, max_new).long().tolist()
    raise ValueError(f"response lengths {kind!r}: expected fixed, uniform or lognormal")
