"""The continuous-batching engine's decoder: prefill and decode steps over a pool of KV-cache slots.

`SlotDecoder` holds one pipeline stage's (one model chunk's) keys and values as `slots` rows of
`cache_len` positions per layer; `trinity.rollout.scheduler.ContinuousScheduler` decides which rows
go to which slot and when. Here:
- every slot has its own position: a row's tokens sit at positions 0.. of its slot (no left padding), so
  RoPE (megatron's table, indexed per row) and the causal mask are those of the row alone;
- prefill runs right-padded prompts at positions 0..s-1 and copies a prompt's keys/values to each of its
  samples' slots (identical prompts are prefilled once);
- a decode step runs the slots [0, b) from static buffers (`tok`, `pos`, `done`, and the previous
  stage's `hidden`), attending over the first `L` cache positions, keys after a row's position masked;
  on CUDA the attention is a Triton split-KV kernel that reads each row's own keys, its prompt's from
  the copy of the slot `lead` names (`share_prefix`; `trinity.rollout.decode_attention`), which on lean
  layers also applies RoPE and stores the step's key and value, with SwiGLU fused too
  (`trinity.rollout.decode_fused`); elsewhere torch's SDPA with an additive mask;
- layers run through `trinity.rollout.decode.StageDecoder`'s layer path, as `StaticDecoder`'s do (the
  lean path with dense SwiGLU MLPs and torch RMSNorms, at TP>1 on this rank's shards with an all-reduce
  after each row-parallel GEMM; megatron's submodules otherwise); this decoder supplies the attention
  over its slots (`_lean_attention`, `_module_attend`);
- on CUDA (dense MLPs, any TP: the all-reduces are captured too) a decode step is one CUDA graph per
  (batch bucket, length bucket), captured
  at first use within a `generate_continuous` call (offload between RL phases moves parameter storages,
  and a graph replays the addresses it was captured with);
- virtual pipeline stages: each model chunk of a rank has its own `SlotDecoder` (its layers' cache),
  the later ones reading the first one's slot state (`state_from`).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F

from trinity.rollout.decode import StageDecoder, capture_graph
from trinity.rollout.kernels import DecodeKernels

# the decode-step shapes this process has run once (SlotDecoder._capture warms a shape up only the first time)
_warmed: set[tuple] = set()


class SlotDecoder(StageDecoder):
    """Prefill and decode steps of one pipeline stage of a megatron GPTModel over a pool of KV slots
    [slots, groups, cache_len, head_dim] per layer, each slot at its own position (module doc). The
    decode step reads its inputs from static buffers (`tok`, `pos`, `hidden`), so on CUDA (dense MLPs)
    each (batch bucket, length bucket) is captured once as a CUDA graph and replayed.

    state_from: another chunk's decoder of the same rank (VPP) whose slot state (`tok`, `pos`, `done`)
    this one reads, so that the caller sets them once for all chunks. `kernels`: the fast paths it may take
    (`trinity.rollout.kernels`; each still only where it runs and passed its first-use check)."""

    def __init__(self, gpt: Any, slots: int, cache_len: int, *, cuda_graphs: bool = True,
                 state_from: "SlotDecoder | None" = None, tail_key: tuple = (), share_prefix: bool = False,
                 kernels: DecodeKernels = DecodeKernels()) -> None:
        # geometry, the per-layer K/V slot pool, megatron's RoPE table, lean path and CUDA-graph eligibility
        super().__init__(gpt, slots, cache_len, cuda_graphs=cuda_graphs)
        rot = self.cos.shape[-1]
        self.slots, self.cache_len = slots, cache_len
        # the decode step's static inputs: token and position of every slot, the previous stage's hidden
        self.owns_state = state_from is None
        self.tok = torch.zeros(slots, dtype=torch.long, device=self.device) if state_from is None else state_from.tok
        self.pos = torch.zeros(slots, dtype=torch.long, device=self.device) if state_from is None else state_from.pos
        self.hidden = None if self.first else torch.zeros(1, slots, self.config.hidden_size, dtype=self.dtype, device=self.device)
        # rows whose sequence ended (or that hold none): the split-KV kernel reads one key for them
        self.done = torch.ones(slots, dtype=torch.bool, device=self.device) if state_from is None else state_from.done
        self.rows = torch.arange(slots, device=self.device)
        # with share_prefix: the slot whose copy of the row's prompt keys the row reads, and the prompt's
        # length (the caller sets both: the scheduler names a slot of the prompt that has not been
        # retired, whose keys stay intact until then)
        self.lead = self.rows.clone() if state_from is None else state_from.lead
        self.plen = torch.zeros(slots, dtype=torch.long, device=self.device) if state_from is None else state_from.plen
        self.kpos = torch.arange(cache_len, device=self.device)
        self._graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, Any]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.use_graph else None
        self.captures, self.capture_s = 0, 0.0
        from trinity.rollout import decode_attention

        # the split-KV kernel reads every key up to a row's position and scores them uncapped: sliding-window
        # layers and Gemma's score caps run in the module path's masked attention (`attend`)
        eager = any(w is not None for w in self.windows) or any(c is not None for c in self.softcaps)
        self.split_kv = kernels.split_kv and not self.mla and not eager and decode_attention.available(
            self.device, self.head_dim, self.heads // self.groups, self.dtype)
        self.attention = "triton split-KV" if self.split_kv else "sdpa"
        # a prompt's n samples each hold a copy of its keys (prefill copies them to every sample's slot); the
        # split-KV kernel reads one copy for all of them, so that neighbouring programs share it in L2
        self.share_prefix = share_prefix and self.split_kv
        # the split-KV kernel's split rule (rows x groups from which a row is one program)
        self.attention_tune = {"full_grid": kernels.full_grid}
        from trinity.rollout import decode_fused

        # RoPE + cache store (in the split-KV kernel where it runs) and SwiGLU fused (lean layers; Qwen3's
        # q/k norms keep the torch ops)
        self.fused = kernels.fused and self.lean and not self.config.qk_layernorm and decode_fused.available(
            self.device, self.head_dim, self.heads // self.groups, rot, self.dtype)
        if self.fused:
            self.attention += " + fused RoPE/SwiGLU"
        if self.share_prefix:
            self.attention += ", shared prompt keys"
        # what a captured step's kernels depend on besides (slots, cache_len, bucket): a shape warmed up
        # once in this process is captured without a warm-up in later rollouts (`_capture`); tail_key:
        # the caller's for the sampling it captures with the step (`step(tail=...)`)
        self.warm_key = (str(self.device), self.dtype, type(gpt), len(self.layers), self.config.hidden_size,
                         self.heads, self.groups, self.head_dim, self.first, self.last, self.lean, self.fused,
                         self.split_kv, self.share_prefix, self.tp_group is not None,
                         # the split-KV threshold decides which kernel variant a bucket compiles
                         kernels.full_grid, *tail_key)

    # ---- its attention over the slot pool: each row at its own position ---------------------------
    def _attend_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: int | None = None) -> torch.Tensor:
        """Causal attention of right-padded prompts: q [b, heads, s, d], k/v [b, groups, s, d]; layer i's
        sliding window and score cap (module path)."""
        window, softcap = (None, None) if i is None else (self.windows[i], self.softcaps[i])
        if window is None and softcap is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        from trinity.models.attention import causal_mask, outside_window
        from trinity.rollout.decode import attend

        s = q.shape[2]
        allowed = ~causal_mask(s, device=q.device)
        if window is not None:
            allowed = allowed & ~outside_window(s, window, device=q.device)
        return attend(q, k, v, allowed, self.scale, softcap)

    def _store_prefill(self, i: int, k: torch.Tensor, v: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy prefill rows `src` of k/v [b, groups, s, d] into slots `dst` (a prompt's n samples share it)."""
        s = k.shape[2]
        self.keys[i][dst, :, :s] = k.index_select(0, src)
        self.values[i][dst, :, :s] = v.index_select(0, src)

    def _attend_extend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ext: dict) -> torch.Tensor:
        """Prompts continued in their slots (`extend`): q [u, heads, s, d] and the new k/v [u, groups, s, d]
        of tokens at positions offset.. of slots `ext["slots"]`; the new keys and values go into the slots
        (the padding's nowhere), then each query attends over its slot's keys up to its own position (the
        cached ones and the new), with layer i's sliding window and score cap."""
        rows, t = ext["valid"]
        self.keys[i][ext["slots"][rows], :, ext["qpos"][rows, t]] = k.permute(0, 2, 1, 3)[rows, t]
        self.values[i][ext["slots"][rows], :, ext["qpos"][rows, t]] = v.permute(0, 2, 1, 3)[rows, t]
        n = ext["keys"]
        kk = self.keys[i].index_select(0, ext["slots"])[:, :, :n]
        vv = self.values[i].index_select(0, ext["slots"])[:, :, :n]
        kpos, qpos = self.kpos[:n].view(1, 1, 1, n), ext["qpos"].view(*ext["qpos"].shape, 1).unsqueeze(1)
        allowed = kpos <= qpos  # [u, 1, s, n]
        if self.windows[i] is not None:
            allowed = allowed & (kpos >= qpos - self.windows[i])
        from trinity.rollout.decode import attend

        return attend(q, kk, vv, allowed, self.scale, self.softcaps[i])

    def _attend_decode(self, i: int, q: torch.Tensor, ctx: dict, rope: bool = False) -> torch.Tensor:
        """One query per row, a group's heads stacked: q [b, g, per, d] against the row's keys 0..pos.
        rope (split-KV only): q is the QKV projection [b, g, per + 2, d], and the kernel applies RoPE and
        stores this step's key and value itself (`decode_attention(rope=...)`)."""
        b, L = q.shape[0], ctx["L"]
        if "allowed" in ctx:  # models with score caps (Gemma 2; module path), windows too
            from trinity.rollout.decode import attend

            allowed = ctx["allowed"]
            if self.windows[i] is not None:
                allowed = allowed & (self.kpos[:L].view(1, 1, 1, L) >= self.pos[:b].view(b, 1, 1, 1) - self.windows[i])
            return attend(q, self.keys[i][:b, :, :L], self.values[i][:b, :, :L], allowed, self.scale, self.softcaps[i])
        if self.split_kv:
            from trinity.rollout.decode_attention import decode_attention

            table = (self.cos, self.sin, self.pos[:b]) if rope else None
            return decode_attention(q, self.keys[i], self.values[i], ctx["nkeys"], L, self.scale,
                                    tune=self.attention_tune, rope=table, prefix=ctx["prefix"])
        return F.scaled_dot_product_attention(q, self.keys[i][:b, :, :L], self.values[i][:b, :, :L],
                                              attn_mask=ctx["bias"][self.windows[i]], scale=self.scale)

    def _rope_in_kernel(self, ctx: dict) -> bool:
        """A decode step of lean layers with the fused kernels (RoPE and the cache store in a kernel)."""
        return ctx["decode"] and self.fused

    def _lean_attention(self, i: int, attn: Any, qkv: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                        ctx: dict) -> torch.Tensor:
        s, b, g, _, d = qkv.shape
        per = self.heads // g
        if self._rope_in_kernel(ctx):
            if self.split_kv:  # RoPE, the cache store and the attention in one kernel
                out = self._attend_decode(i, qkv[0], ctx, rope=True)
            else:
                from trinity.rollout.decode_fused import rope_store

                q = rope_store(qkv[0], self.cos, self.sin, self.pos[:b], self.keys[i], self.values[i])
                out = self._attend_decode(i, q, ctx)
            return out.reshape(b, g * per * d)
        q, k, v = self._lean_qkv(attn, qkv, cos, sin)
        if ctx["decode"]:
            # s == 1: write this step's key/value at each row's own position, then attend over the first
            # L positions with the group's query heads stacked along the query axis (no repeated K/V)
            self.keys[i][self.rows[:b], :, self.pos[:b]] = k[0, :, :, 0]
            self.values[i][self.rows[:b], :, self.pos[:b]] = v[0]
            return self._attend_decode(i, q[0], ctx).reshape(b, g * per * d)  # q [b, g, per, d]
        kk, vv = k.squeeze(3).permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)  # [b, g, s, d]
        qq = q.permute(1, 2, 3, 0, 4).reshape(b, g * per, s, d)
        if "extend" in ctx:
            return self._attend_extend(i, qq, kk, vv, ctx["extend"]).permute(2, 0, 1, 3).reshape(s * b, g * per * d)
        self._store_prefill(i, kk, vv, ctx["src"], ctx["dst"])
        return self._attend_prefill(qq, kk, vv, i).permute(2, 0, 1, 3).reshape(s * b, g * per * d)

    def _swiglu(self, up: torch.Tensor) -> torch.Tensor:
        if not self.fused:
            return super()._swiglu(up)
        from trinity.rollout.decode_fused import silu_mul

        return silu_mul(up)

    def _module_attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: dict) -> torch.Tensor:
        b = q.shape[1]
        if ctx["decode"]:
            self.keys[i][self.rows[:b], :, self.pos[:b]] = k[0]
            self.values[i][self.rows[:b], :, self.pos[:b]] = v[0]
            per = self.heads // self.groups
            out = self._attend_decode(i, q[0].reshape(b, self.groups, per, self.head_dim), ctx)
            return out.reshape(b, self.heads, 1, self.v_dim)
        kk, vv = k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)
        if "extend" in ctx:
            return self._attend_extend(i, q.permute(1, 2, 0, 3), kk, vv, ctx["extend"])
        self._store_prefill(i, kk, vv, ctx["src"], ctx["dst"])
        return self._attend_prefill(q.permute(1, 2, 0, 3), kk, vv, i)

    # ---- prefill -----------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                hidden: torch.Tensor | None) -> torch.Tensor:
        """Right-padded prompts tokens [u, s] (lengths [u]) at positions 0..s-1; prompt src[j]'s keys and
        values go to slot dst[j]. Returns each prompt's last-token logits [u, vocab] (last stage) or the
        hidden states [s, u, h] to send on."""
        u, s = tokens.shape
        positions = torch.arange(s, device=self.device).view(s, 1).expand(s, u)
        x = self._embed(tokens, positions.t(), hidden)
        x = self._layers(x, positions, {"decode": False, "src": src, "dst": dst})
        if not self.last:
            return x
        last = x[lengths - 1, torch.arange(u, device=self.device)].unsqueeze(0)  # [1, u, h]
        return self._logits(last)

    @torch.no_grad()
    def extend(self, tokens: torch.Tensor, lengths: torch.Tensor, offsets: torch.Tensor, slots: torch.Tensor,
               hidden: torch.Tensor | None) -> torch.Tensor:
        """Prompts continued in their slots: row j's tokens [u, s] (right-padded, lengths[j] of them) sit at
        positions offsets[j].. of slot slots[j], whose positions 0..offsets[j]-1 hold the keys and values of
        the prompt's first offsets[j] tokens (a parked slot taken again: `SlotTable`). Returns each row's
        last-token logits [u, vocab] (last stage) or the hidden states [s, u, h] to send on, as `prefill`."""
        u, s = tokens.shape
        qpos = offsets.view(u, 1) + torch.arange(s, device=self.device).view(1, s)  # [u, s]
        valid = (torch.arange(s, device=self.device).view(1, s) < lengths.view(u, 1)).nonzero(as_tuple=True)
        ext = {"slots": slots, "qpos": qpos, "valid": valid, "keys": int((offsets + lengths).max())}
        positions = qpos.clamp(max=self.cache_len - 1).t()  # [s, u]; the padding's positions are never kept
        x = self._embed(tokens, positions.t(), hidden)
        x = self._layers(x, positions, {"decode": False, "extend": ext})
        if not self.last:
            return x
        last = x[lengths - 1, torch.arange(u, device=self.device)].unsqueeze(0)  # [1, u, h]
        return self._logits(last)

    # ---- decode ------------------------------------------------------------------------------------
    def _step(self, b: int, L: int) -> torch.Tensor:
        pos = self.pos[:b]
        # additive mask: a row attends to its positions 0..pos (written by its prefill and earlier steps)
        # (a sliding-window layer's: also the keys more than its window before pos)
        bias = None
        if not self.split_kv:
            kpos, at = self.kpos[:L].view(1, 1, 1, L), pos.view(b, 1, 1, 1)
            bias = {w: torch.zeros(b, 1, 1, L, dtype=self.dtype, device=self.device).masked_fill_(
                (kpos > at) if w is None else (kpos > at) | (kpos < at - w), float("-inf")) for w in set(self.windows)}
        nkeys = torch.where(self.done[:b], torch.ones_like(pos), pos + 1) if self.split_kv else None
        prefix = (self.lead[:b], self.plen[:b]) if self.share_prefix else None
        ctx = {"decode": True, "L": L, "bias": bias, "nkeys": nkeys, "prefix": prefix}
        if any(c is not None for c in self.softcaps):  # capped scores need a boolean mask (windows narrow it)
            ctx["allowed"] = self.kpos[:L].view(1, 1, 1, L) <= pos.view(b, 1, 1, 1)
        x = self._embed(self.tok[:b].view(b, 1), pos.view(b, 1), None if self.first else self.hidden[:, :b])
        x = self._layers(x, pos.view(1, b), ctx)
        return self._logits(x) if self.last else x

    @torch.no_grad()
    def step(self, b: int, L: int, hidden: torch.Tensor | None = None, tail: Any = None) -> Any:
        """One token for each of the slots [0, b) from `tok`/`pos` (set by the caller), attending over the
        first L positions; `hidden` [1, b, h] from the previous stage (non-first stages). Returns logits
        [b, vocab] (last stage) or hidden states [1, b, h] (a graph's output buffer: valid until the
        next step); with `tail`, what tail(b, that output, book=True) returns: the engine's sampling and
        bookkeeping, captured in the same CUDA graph (the same function at every step of a decoder;
        book=False must compute without side effects: the warm-up before a capture runs it so)."""
        if self.hidden is not None:
            assert hidden is not None, "a non-first pipeline stage needs the previous stage's hidden state"
            self.hidden[:, :b].copy_(hidden)
        if not self.use_graph:
            out = self._step(b, L)
            return out if tail is None else tail(b, out, book=True)
        key = (b, L, tail is not None)
        if key not in self._graphs:
            self._capture(key, tail)
        graph, out = self._graphs[key]
        graph.replay()
        return out

    def _capture(self, key: tuple[int, int, bool], tail: Any) -> None:
        # A warm-up run before capture (lazy inits, cuBLAS workspaces, Triton compiles and first-use checks
        # for this shape), as torch advises, once per process and shape: later rollouts (every RL step
        # captures its own graphs) skip it. Its cache writes are those the replay makes again (same tokens
        # at the same positions); its tail runs without booking (book=False).
        start = time.perf_counter()
        b, L = key[0], key[1]
        shape = (*self.warm_key, self.slots, self.cache_len, *key)

        def warm() -> None:
            out = self._step(b, L)
            if tail is not None:
                tail(b, out, book=False)

        def run() -> Any:
            out = self._step(b, L)
            return out if tail is None else tail(b, out, book=True)

        self._graphs[key] = capture_graph(run, pool=self._pool, warm=None if shape in _warmed else warm)
        _warmed.add(shape)
        self.captures += 1
        self.capture_s += time.perf_counter() - start

    def close(self) -> None:
        """Drop the KV cache and the graphs when the rollout ends, not when the last reference to this
        decoder (the scheduler's, a caller's) goes."""
        self.keys, self.values = [], []
        self._graphs.clear()

    @torch.no_grad()
    def move(self, src: list[int], dst: list[int]) -> None:
        """Move the KV cache rows of slots `src` to slots `dst` (compaction)."""
        s = torch.tensor(src, device=self.device)
        d = torch.tensor(dst, device=self.device)
        for cache in (*self.keys, *self.values):
            cache.index_copy_(0, d, cache.index_select(0, s))
        for buf in (self.tok, self.pos, self.plen) if self.owns_state else ():
            buf.index_copy_(0, d, buf.index_select(0, s))
