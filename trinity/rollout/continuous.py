"""The continuous-batching rollout engine: a pool of KV-cache slots sized from a memory budget.

Why: the static path (`trinity.rollout.generate.generate`) decodes every row of a rollout as one batch
until its longest row ends, over a cache of the final length, with no memory bound. Here:
- the KV cache is a pool of `slots` rows of `cache_len` tokens per layer of this pipeline stage, with
  `slots = min(max_num_seqs, budget // bytes per slot, rows)`; the budget is `kv_cache_memory_gib`, else
  `gpu_memory_utilization` x the memory free when the rollout starts (host memory on CPU)
  (`trinity.rollout.kv_budget`);
- a row that ends (EOS or `max_new_tokens`) frees its slot; waiting rows are prefilled into free slots
  (a rollout larger than the pool runs in waves, each row's tokens unchanged);
- identical prompts (a prompt's n samples) are prefilled ONCE per admission and their keys/values copied
  to each sample's slot; on CUDA a decode step's split-KV kernel reads the prompt's keys from one of
  those slots for all of its samples (`set_leads`), so that they come from DRAM about once per step
  instead of n times;
- every slot has its own position, so a row's RoPE and causal mask are those of the row alone. A decode
  step runs the slots [0, b) with b the batch bucket above the highest live slot (`trinity.rollout.buckets`:
  powers of two, then multiples of 64, leaving out on CUDA those whose GEMMs are slower than a larger
  one's), attending over the first `L` cache positions, L the longest live context rounded up to
  `_LEN_BUCKET` (a step reads the live context, not the whole cache). When no rows wait, live slots are
  compacted to the front so that the tail of a rollout runs small buckets.
The prefill and decode steps over the pool (per-row RoPE, the attention kernels, one CUDA graph per
(batch bucket, length bucket) on CUDA) are `trinity.rollout.slots.SlotDecoder`'s.

Sampling (temperature / top-k / top-p), EOS handling, the returned `Rollout` layout and log-probs are
those of `trinity.rollout.generate` (the same `trinity.rollout.sampler.Sampler`, log p under the
temperature-1 distribution). With the fused sampler a row's draws are named by (output row, token index)
and do not depend on its slot or wave. On CUDA (one stage, TP=1, the fused sampler) a decode step's
sampling and bookkeeping are captured in the step's CUDA graph with its layers: one replay per step
(at TP>1 the graph holds the layers and their all-reduces, the sampling runs after it).
Tensor parallelism: TP rank 0's samples are broadcast to its group. Pipeline parallelism: each stage
keeps its own layers' KV cache, hidden states go stage to stage (`_Pipeline`), the last stage samples
and broadcasts the tokens every step; every rank derives "which rows ended" from those tokens with the
same rule, so all ranks of a model-parallel group make the same scheduling decisions (the slot count
is the minimum over the group). Virtual pipeline stages (VPP): a rank holds several model chunks, each
with its own `SlotDecoder` (its layers' KV cache) sharing one slot state (tokens, positions, ended
flags); every prefill and decode step runs the chunks in order, hidden states going around the ring of
stages between them (`_Pipeline`). On CUDA "which rows ended" is read one step late (the host does not
wait for each step); a row that ended keeps a slot one extra step, computing nothing that is kept.

`KVBudget`, `plan_slots`, `SlotDecoder` and the benchmark-only EOS schedule (`bench_response_lengths`,
`draw_response_lengths`) live in their own modules and are re-exported here, where callers import them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

# re-exported: tests, benchmarks and the RL recipe import these from here
from trinity.rollout.bench_lengths import BENCH_LENGTHS_ENV, bench_response_lengths, draw_response_lengths  # noqa: F401
from trinity.rollout.buckets import decode_buckets
from trinity.rollout.kv_budget import (  # noqa: F401
    DEFAULT_GPU_MEMORY_UTILIZATION, KVBudget, free_memory, kv_bytes_per_token, plan_slots)
from trinity.rollout.sampler import Sampler
from trinity.rollout.slots import SlotDecoder
from trinity.rollout.types import BucketTime, Rollout, RolloutStats, SamplingParams  # noqa: F401

_LEN_BUCKET = 256  # attention reads the cache up to the longest live context rounded up to this
_CACHE_MULTIPLE = 64
_PREFILL_TOKENS = 16384  # padded prompt tokens per prefill forward (bounds its activations)


def _clock(device: torch.device) -> Any:
    """A step's start or end mark for `RolloutStats.time_buckets`: a CUDA event recorded on the current stream
    (read once the rollout ends, so the host never waits for it), or the CPU's clock."""
    import time

    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


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
    from trinity.rollout.generate import _Pipeline, left_pad

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
    # the batch buckets (CUDA: tuned by timing this stage's GEMMs, before the cache takes the memory)
    buckets = decode_buckets(gpts, slots, device)
    stats.bucket_note = buckets.note
    pipe = _Pipeline(gpts, device, param.dtype)
    sampler = Sampler(params, generator, device, vocab_size)
    # one decoder per model chunk; `dec` (chunk 0) holds the slot state all of them read; tail_key: what
    # the sampling captured with a step compiles for (SlotDecoder warms a shape up once per process)
    tail_key = (sampler.label, params.temperature, vocab_size, max_new, rows, len(set(params.eos_token_ids)))
    # the waiting rows, grouped by prompt (a prompt's samples are prefilled once when admitted together)
    groups: dict[tuple[int, ...], list[int]] = {}
    for r, p in enumerate(prompts):
        groups.setdefault(tuple(p), []).append(r)
    # a prompt's samples read one copy of its keys (TRINITY_SHARED_PROMPT_KEYS=0: each its own, a diagnostic)
    share = any(len(g) > 1 for g in groups.values()) and os.environ.get("TRINITY_SHARED_PROMPT_KEYS", "1") != "0"
    dec = SlotDecoder(gpts[0], slots, cache_len, cuda_graphs=cuda_graphs, tail_key=tail_key, share_prefix=share)
    decs = [dec] + [SlotDecoder(g, slots, cache_len, cuda_graphs=cuda_graphs, state_from=dec, tail_key=tail_key,
                                share_prefix=share) for g in gpts[1:]]
    stats.rows, stats.slots, stats.cache_len, stats.kv_bytes_per_token = rows, slots, cache_len, kv_bytes_per_token(gpts)
    eos = torch.tensor(sorted(set(params.eos_token_ids)) or [-1], device=device)
    # one CUDA graph per step for the layers, the sampling and the bookkeeping: one stage, one chunk, the
    # fused sampler (the torch ops' multinomial draws from a generator the graph would not advance), TP=1
    # (at TP>1 the graph holds the layers; the sampler's broadcast from TP rank 0 runs after it)
    graph_tail = dec.use_graph and pipe.size == 1 and len(decs) == 1 and sampler.fused and dec.tp_group is None
    stats.sampler, stats.graph_tail = sampler.label, graph_tail

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

    waiting: list[list[int]] = list(groups.values())
    n_waiting = rows
    free = list(range(slots))  # kept sorted: new rows take the lowest slots
    slot_row = [-1] * slots  # host view: the row a slot holds (-1 = free)
    slot_admit = [0] * slots  # iteration of admission (flags snapshotted before it do not apply)
    slot_pos = [0] * slots  # upper bound of the slot's next position (host's estimate for L)
    slot_grp, slot_plen = [-1] * slots, [0] * slots  # the slot's prompt (id per prompt and prefill), its length
    next_grp = 0
    leads_stale = False  # which slot holds what changed since `set_leads` last ran
    active_set: set[int] = set()  # slots holding a row that has not been retired
    flags = _DoneFlags(device, slots)
    # time_buckets: (bucket, live rows, live KV, read KV, start, end) per decode step, read after the loop
    step_events: list[tuple[int, int, int, int, Any, Any]] | None = [] if stats.time_buckets else None
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
        # a broadcast compare, not torch.isin: with more than a few EOS ids isin sorts and waits on the
        # host, which a CUDA graph capture refuses (`graph_tail`)
        ended = (nxt.unsqueeze(1) == eos.unsqueeze(0)).any(1)
        done[idx] = done[idx] | (live & (ended | (n >= limit[r])))
        dec.tok[idx] = torch.where(live, nxt, dec.tok[idx])

    def keys(idx: torch.Tensor) -> torch.Tensor:
        """What names the draw of slots `idx`' next tokens (trinity.rollout.sampler): output row x
        max_new + the token's index in its response, whatever the slot or the wave."""
        return row_of[idx] * max_new + count[idx]

    def sample_broadcast(logits: torch.Tensor | None, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = idx.numel()
        if pipe.last:
            nxt, logp = sampler(logits, keys(idx))
        else:
            nxt = torch.empty(n, dtype=torch.long, device=device)
            logp = torch.zeros(n, dtype=torch.float32, device=device)
        return pipe.from_last(nxt), logp

    def tail(b: int, logits: torch.Tensor, book: bool = True) -> None:
        """Sampling and bookkeeping of a decode step over slots [0, b), inside its CUDA graph (`graph_tail`);
        book=False: the sampling alone (the warm-up before a capture)."""
        idx = dec.rows[:b]
        live = ~done[:b]
        nxt, logp = sampler(logits, keys(idx))
        if book:
            record(idx, nxt, logp, live)
            dec.pos[:b] += live.long()

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
        nonlocal n_waiting, next_grp, leads_stale
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
        dec.plen[dst] = lengths.index_select(0, src)
        nxt, logp = sample_broadcast(out.index_select(0, src) if pipe.last else None, dst)
        record(dst, nxt, logp, torch.ones_like(dst, dtype=torch.bool))
        for (r, s), j in zip(pairs, src_l):
            slot_row[s], slot_admit[s], slot_pos[s] = r, it, len(chunk[j][0])
            slot_grp[s], slot_plen[s] = next_grp + j, len(chunk[j][0])
            n_waiting -= 1
        next_grp += u
        leads_stale = True

    leads = list(range(slots))  # the host's copy of dec.lead

    def set_leads() -> None:
        """Shared prompt keys: each active slot reads its prompt's keys from the lowest active slot of its
        prompt (an active slot's cache is not reused before `retire` frees it, and the new leads reach the
        device before the next step). Run after admissions, retirements and compactions only, and queued
        only when the leads changed: rows end one at a time in the tail."""
        nonlocal leads_stale
        leads_stale = False
        first: dict[int, int] = {}
        new = list(range(slots))
        for s in sorted(active_set):
            new[s] = first.setdefault(slot_grp[s], s)
        if new != leads:
            leads[:] = new
            dec.lead.copy_(torch.tensor(new, dtype=torch.long).pin_memory() if device.type == "cuda"
                           else torch.tensor(new, dtype=torch.long), non_blocking=True)

    def retire(snap: tuple[int, torch.Tensor] | None) -> None:
        nonlocal leads_stale
        if snap is None:
            return
        it, ended = snap
        flags_now = ended.tolist()  # one host read, not one per slot
        for s in list(active_set):
            if slot_admit[s] < it and flags_now[s]:
                slot_row[s] = -1
                active_set.discard(s)
                free.append(s)
                leads_stale = True
        free.sort()

    def compact(it: int) -> None:
        """No rows wait: move the live slots above the bucket of the live count into lower free slots."""
        nonlocal leads_stale
        live = sorted(active_set)
        if not live or buckets(live[-1] + 1) <= buckets(len(live)):
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
            slot_grp[d], slot_plen[d] = slot_grp[s], slot_plen[s]
            slot_row[s] = -1
            active_set.discard(s)
            active_set.add(d)
        free[:] = sorted(set(free) - set(dst) | set(src))
        leads_stale = True

    it = 0
    try:
        while True:
            snap = None
            if active_set:
                active = sorted(active_set)
                b = buckets(active[-1] + 1)
                # SDPA reads all L keys of a row: L follows the longest live row; the split-KV kernel reads
                # each row's own keys whatever L is: one L, one graph per batch bucket
                L = cache_len if dec.split_kv else min(
                    cache_len, -(-(max(slot_pos[s] for s in active) + 1) // _LEN_BUCKET) * _LEN_BUCKET)
                if step_events is not None:
                    ev0 = _clock(device)
                if graph_tail:
                    dec.step(b, L, tail=tail)
                else:
                    live = ~done[:b]
                    for v, d in enumerate(decs):
                        out = d.step(b, L, pipe.recv(1, b, v))
                        pipe.send(out, v)
                    idx = dec.rows[:b]
                    nxt, logp = sample_broadcast(out if pipe.last else None, idx)
                    record(idx, nxt, logp, live)
                    dec.pos[:b] += live.long()
                live_ctx = shared_ctx = 0
                seen: set[int] = set()
                for s in active:
                    slot_pos[s] = min(slot_pos[s] + 1, cache_len - 1)
                    live_ctx += slot_pos[s]
                    # with shared prompts a prompt's keys count once per step
                    shared_ctx += slot_pos[s] - (slot_plen[s] if dec.share_prefix and slot_grp[s] in seen else 0)
                    seen.add(slot_grp[s])
                if step_events is not None:
                    step_events.append((b, len(active), live_ctx, shared_ctx, ev0, _clock(device)))
                stats.decode_steps += 1
                stats.slot_steps += b
                stats.live_kv_tokens += live_ctx
                stats.read_kv_tokens += shared_ctx
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
            if dec.share_prefix and leads_stale:
                set_leads()
            it += 1
    finally:
        for g, training in zip(gpts, was_training):
            g.train(training)
        for d in decs:
            d.close()
    stats.graph_captures, stats.capture_s = sum(d.captures for d in decs), sum(d.capture_s for d in decs)
    if step_events:
        if device.type == "cuda":
            step_events[-1][5].synchronize()
        for b, live_rows, live_ctx, shared_ctx, ev0, ev1 in step_events:
            bt = stats.buckets.setdefault(b, BucketTime())
            bt.steps += 1
            bt.ms += ev0.elapsed_time(ev1) if device.type == "cuda" else (ev1 - ev0) * 1e3
            bt.live_rows += live_rows
            bt.live_kv_tokens += live_ctx
            bt.read_kv_tokens += shared_ctx
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
    time_buckets: bool = False  # time the decode steps per batch bucket (a profiled RL step sets it)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 generator: torch.Generator | None = None) -> Rollout:
        self.stats = RolloutStats(time_buckets=self.time_buckets)
        lengths = bench_response_lengths(len(prompts), params.max_new_tokens)
        return generate_continuous(self.model, prompts, params, vocab_size=self.vocab_size, pad_id=self.pad_id,
                                   budget=self.budget, generator=generator, response_lengths=lengths, stats=self.stats)
