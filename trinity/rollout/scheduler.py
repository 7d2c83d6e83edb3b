"""The continuous engine's scheduler: admits prompt groups into KV-cache slots, runs prefill and decode steps
over the slot pool, books the sampled tokens, retires ended rows and compacts the live ones.

`ContinuousScheduler` carries out what its `trinity.rollout.slot_table.SlotTable` (the host's
bookkeeping, testable without a model) decides, on this rank's `SlotDecoder`s (one per model chunk) and
the device's per-slot state (`row_of`, `count`, the decoders' `tok`/`pos`/`done`). One `step()` is one
iteration: a decode step over the live slots (or, with none, the last lagged flags), the retirement of
the rows that ended, then an admission or a compaction, then the shared-prompt leads. `step()` returns
the rows that ended in it, and groups can be added between steps (`add`): what partial rollouts and
multi-turn workflows build on. `run()` steps until every row has ended and returns the `Rollout`.

The engine as a whole (budget, buckets, shared prompt keys, CUDA graphs, pipeline and tensor
parallelism) is described in `trinity.rollout.continuous`.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from trinity.rollout.buckets import Buckets
from trinity.rollout.layout import assemble, left_pad
from trinity.rollout.parallel import Pipeline
from trinity.rollout.sampler import Sampler
from trinity.rollout.slot_table import Group, Move, Placement, SlotTable, prefill_chunks
from trinity.rollout.slots import SlotDecoder
from trinity.rollout.types import BucketTime, Rollout, RolloutStats, SamplingParams

LEN_BUCKET = 256  # attention reads the cache up to the longest live context rounded up to this


def _clock(device: torch.device) -> Any:
    """A step's start or end mark for `RolloutStats.time_buckets`: a CUDA event recorded on the current stream
    (read once the rollout ends, so the host never waits for it), or the CPU's clock."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class DoneFlags:
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


class ContinuousScheduler:
    """One rollout over a slot pool (module doc). `decs`: this rank's decoders, one per model chunk, the
    first holding the slot state; `rows`: the output rows (every row index a group names is below it);
    `response_lengths` (benchmarks): row i also ends after that many tokens; `graph_tail`: the step's
    sampling and bookkeeping run inside its CUDA graph (`tail`)."""

    def __init__(self, decs: Sequence[SlotDecoder], pipe: Pipeline, sampler: Sampler, buckets: Buckets,
                 params: SamplingParams, *, rows: int, pad_id: int, stats: RolloutStats, graph_tail: bool,
                 response_lengths: Sequence[int] | None = None) -> None:
        self.decs, self.dec, self.pipe, self.sampler, self.buckets = list(decs), decs[0], pipe, sampler, buckets
        dec = self.dec
        self.device, self.rows, self.pad_id, self.stats = dec.device, rows, pad_id, stats
        self.max_new = max_new = params.max_new_tokens
        self.graph_tail = graph_tail
        self.table = SlotTable(dec.slots, dec.cache_len)
        self.flags = DoneFlags(self.device, dec.slots)
        self.eos = torch.tensor(sorted(set(params.eos_token_ids)) or [-1], device=self.device)
        device = self.device
        # outputs: one extra row (`rows`) takes the writes of slots that hold no live row
        self.out_tokens = torch.full((rows + 1, max_new), pad_id, dtype=torch.long, device=device)
        self.out_logp = torch.zeros((rows + 1, max_new), dtype=torch.float32, device=device)
        self.out_len = torch.zeros(rows + 1, dtype=torch.long, device=device)
        self.limit = torch.full((rows + 1,), max_new, dtype=torch.long, device=device)
        # what names a row's draws (`keys`): row x max_new unless `start_rows` names it otherwise
        self.key_base = torch.arange(rows + 1, dtype=torch.long, device=device) * max_new
        if response_lengths is not None:
            self.limit[:rows] = torch.tensor([max(1, min(max_new, int(n))) for n in response_lengths], device=device)
        # per slot: its output row, tokens generated so far, whether its row has ended (the decoder's)
        self.row_of = torch.full((dec.slots,), rows, dtype=torch.long, device=device)
        self.count = torch.zeros(dec.slots, dtype=torch.long, device=device)
        self.done = dec.done
        self.it = 0
        self.finished = False
        # time_buckets: (bucket, live rows, live KV, read KV, start, end) per decode step, read in `finish`
        self.step_events: list[tuple[int, int, int, int, Any, Any]] | None = [] if stats.time_buckets else None
        self.prefill_events: list[tuple[Any, Any]] = []  # (start, end) of each prefill forward (time_buckets)

    def add(self, groups: Sequence[Group]) -> None:
        """Prompt groups that wait for slots (their rows below `rows`)."""
        assert all(0 <= r < self.rows for g in groups for r in g.rows)
        self.table.add(groups)
        self.finished = False

    # ---- booking (also inside a step's CUDA graph) --------------------------------------------------
    def record(self, idx: torch.Tensor, nxt: torch.Tensor, logp: torch.Tensor, live: torch.Tensor) -> None:
        """Book the sampled tokens of slots `idx` (live: the slot's row has not ended)."""
        rows, max_new, dec = self.rows, self.max_new, self.dec
        r = torch.where(live, self.row_of[idx], torch.full_like(idx, rows))
        c = self.count[idx].clamp(max=max_new - 1)
        self.out_tokens.index_put_((r, c), torch.where(live, nxt, torch.full_like(nxt, self.pad_id)))
        self.out_logp.index_put_((r, c), torch.where(live, logp, torch.zeros_like(logp)))
        n = self.count[idx] + live.long()
        self.count[idx] = n
        self.out_len[r] = n
        # a broadcast compare, not torch.isin: with more than a few EOS ids isin sorts and waits on the
        # host, which a CUDA graph capture refuses (`graph_tail`)
        ended = (nxt.unsqueeze(1) == self.eos.unsqueeze(0)).any(1)
        self.done[idx] = self.done[idx] | (live & (ended | (n >= self.limit[r])))
        dec.tok[idx] = torch.where(live, nxt, dec.tok[idx])

    def start_rows(self, rows: Sequence[int], keys: Sequence[int], limits: Sequence[int]) -> None:
        """Before rows are added: row rows[i]'s first draw is named keys[i] (its next ones keys[i] + 1, ...)
        and it ends after limits[i] tokens at most (partial rollouts: an answer continued from where it
        stopped, named by its sample and the token's index in the whole answer)."""
        if not rows:
            return
        r = torch.tensor(list(rows), dtype=torch.long, device=self.device)
        self.key_base[r] = torch.tensor(list(keys), dtype=torch.long, device=self.device)
        self.limit[r] = torch.minimum(self.limit[r], torch.tensor([max(1, int(n)) for n in limits], device=self.device))

    def keys(self, idx: torch.Tensor) -> torch.Tensor:
        """What names the draw of slots `idx`' next tokens (trinity.rollout.sampler): by default output
        row x max_new + the token's index in its response, whatever the slot or the wave (`start_rows`)."""
        return self.key_base[self.row_of[idx]] + self.count[idx]

    def sample_broadcast(self, logits: torch.Tensor | None, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = idx.numel()
        if self.pipe.last:
            nxt, logp = self.sampler(logits, self.keys(idx))
        else:
            nxt = torch.empty(n, dtype=torch.long, device=self.device)
            logp = torch.zeros(n, dtype=torch.float32, device=self.device)
        return self.pipe.from_last(nxt), logp

    def tail(self, b: int, logits: torch.Tensor, book: bool = True) -> None:
        """Sampling and bookkeeping of a decode step over slots [0, b), inside its CUDA graph (`graph_tail`);
        book=False: the sampling alone (the warm-up before a capture)."""
        dec = self.dec
        idx = dec.rows[:b]
        live = ~self.done[:b]
        nxt, logp = self.sampler(logits, self.keys(idx))
        if book:
            self.record(idx, nxt, logp, live)
            dec.pos[:b] += live.long()

    # ---- the scheduler's moves ----------------------------------------------------------------------
    def admit(self) -> None:
        """Admit waiting groups into free slots (`SlotTable.admit`) and prefill them in chunks of at most
        `PREFILL_TOKENS` padded tokens."""
        take = self.table.admit()
        self.stats.waves += 1
        for chunk in prefill_chunks(take):
            self.prefill(chunk)

    def prefill(self, chunk: Sequence[Placement]) -> None:
        """One prefill forward of `chunk`'s prompts (right-padded), their keys and values copied to each of
        their rows' slots, and each row's first token sampled and booked. A chunk of prompts with cached
        tokens (parked slots taken again; one row each) computes only the tokens past them, in the slots
        (`SlotDecoder.extend`)."""
        device, pipe, dec = self.device, self.pipe, self.dec
        u, width = len(chunk), max(c.computed for c in chunk)
        tok = torch.full((u, width), self.pad_id, dtype=torch.long)
        for j, item in enumerate(chunk):
            tok[j, : item.computed] = torch.tensor(item.prompt[item.cached:], dtype=torch.long)
        lengths = torch.tensor([c.computed for c in chunk], device=device)
        src_l = [j for j, item in enumerate(chunk) for _ in item.pairs]
        pairs = [pr for item in chunk for pr in item.pairs]
        src = torch.tensor(src_l, device=device)
        dst = torch.tensor([s for _, s in pairs], device=device)
        tok = tok.to(device)
        cached = chunk[0].cached > 0  # `prefill_chunks` keeps the two kinds apart
        offsets = torch.tensor([c.cached for c in chunk], device=device)
        ev0 = _clock(device) if self.step_events is not None else None
        for v, d in enumerate(self.decs):
            hidden = pipe.recv(width, u, v)
            out = d.extend(tok, lengths, offsets, dst, hidden) if cached else d.prefill(tok, lengths, src, dst, hidden)
            pipe.send(out, v)
        if ev0 is not None:
            self.prefill_events.append((ev0, _clock(device)))
        self.stats.prefill_calls += 1
        self.stats.prefilled_prompts += u
        self.stats.prefilled_tokens += sum(c.computed for c in chunk)
        self.stats.reused_tokens += sum(c.cached for c in chunk)
        self.row_of[dst] = torch.tensor([r for r, _ in pairs], device=device)
        self.count[dst] = 0
        self.done[dst] = False
        full = torch.tensor([len(c.prompt) for c in chunk], device=device)
        dec.pos[dst] = full.index_select(0, src)  # the first sampled token goes at position len(prompt)
        dec.plen[dst] = full.index_select(0, src)
        nxt, logp = self.sample_broadcast(out.index_select(0, src) if pipe.last else None, dst)
        self.record(dst, nxt, logp, torch.ones_like(dst, dtype=torch.bool))
        self.table.placed(chunk, self.it)

    def set_leads(self) -> None:
        """Shared prompt keys: each active slot reads its prompt's keys from the lowest active slot of its
        prompt (`SlotTable.new_leads`); the new leads reach the device before the next step. Run after
        admissions, retirements and compactions only, and queued only when the leads changed."""
        new = self.table.new_leads()
        if new is None:
            return
        lead = torch.tensor(new, dtype=torch.long)
        self.dec.lead.copy_(lead.pin_memory() if self.device.type == "cuda" else lead, non_blocking=True)

    def retire(self, snap: tuple[int, torch.Tensor] | None) -> list[int]:
        """Free the slots of the rows a flags snapshot says ended; returns those rows."""
        if snap is None:
            return []
        it, ended = snap
        return self.table.retire(it, ended.tolist())  # one host read, not one per slot

    def compact(self) -> None:
        """No rows wait: move the live slots above the bucket of the live count into lower free slots."""
        move = self.table.compaction(self.buckets)
        if move is None:
            return
        self.move(move)

    def move(self, move: Move) -> None:
        src, dst = list(move.src), list(move.dst)
        for d in self.decs:
            d.move(src, dst)
        sl, dl = torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device)
        for buf in (self.row_of, self.count, self.done):
            buf.index_copy_(0, dl, buf.index_select(0, sl))
        self.done[sl] = True
        self.row_of[sl] = self.rows
        self.table.moved(move, self.it)

    def decode(self) -> tuple[int, torch.Tensor] | None:
        """One decode step over the slots [0, b) that hold the active rows; returns a flags snapshot."""
        table, dec, pipe, device, stats = self.table, self.dec, self.pipe, self.device, self.stats
        b = table.batch(self.buckets)
        # SDPA reads all L keys of a row: L follows the longest live row; the split-KV kernel reads
        # each row's own keys whatever L is: one L, one graph per batch bucket
        L = dec.cache_len if dec.split_kv else table.context(LEN_BUCKET)
        if self.step_events is not None:
            ev0 = _clock(device)
        if self.graph_tail:
            dec.step(b, L, tail=self.tail)
        else:
            live = ~self.done[:b]
            for v, d in enumerate(self.decs):
                out = d.step(b, L, pipe.recv(1, b, v))
                pipe.send(out, v)
            idx = dec.rows[:b]
            nxt, logp = self.sample_broadcast(out if pipe.last else None, idx)
            self.record(idx, nxt, logp, live)
            dec.pos[:b] += live.long()
        active = len(table.active)
        # with shared prompts a prompt's keys count once per step
        live_ctx, shared_ctx = table.advance(dec.share_prefix)
        if self.step_events is not None:
            self.step_events.append((b, active, live_ctx, shared_ctx, ev0, _clock(device)))
        stats.decode_steps += 1
        stats.slot_steps += b
        stats.live_kv_tokens += live_ctx
        stats.read_kv_tokens += shared_ctx
        return self.flags.record(self.it, self.done)

    def step(self) -> list[int]:
        """One iteration (module doc); returns the rows that ended in it (known one step late on CUDA)."""
        table = self.table
        snap = self.decode() if table.active else self.flags.flush()
        ended = self.retire(snap)
        if table.wants_admission():
            self.admit()
        elif not table.n_waiting and len(table.free) < table.slots:
            self.compact()
        if table.finished and self.flags.pending is None:
            self.finished = True
            return ended
        if self.dec.share_prefix and table.leads_stale:
            self.set_leads()
        self.it += 1
        return ended

    def run(self) -> None:
        """Step until every row has ended."""
        while not self.finished:
            self.step()

    def close(self) -> None:
        for d in self.decs:
            d.close()

    def finish(self, prompts: Sequence[Sequence[int]]) -> Rollout:
        """The rollout of `prompts` (every row ended; row i's prompt is prompts[i]); the stats' timings."""
        self.book_stats()
        rows, device = self.rows, self.device
        lengths = self.out_len[:rows]
        width = int(lengths.max())
        self.stats.tokens = int(lengths.sum())
        tokens, prompt_mask = left_pad(prompts, self.pad_id, device)
        logprobs = self.pipe.from_last(self.out_logp[:rows, :width].contiguous())
        return assemble(tokens, prompt_mask, self.out_tokens[:rows, :width], lengths, logprobs)

    def book_stats(self) -> None:
        """The stats the rollout's end knows: graph captures, the attention path, the per-bucket step
        times (`RolloutStats.time_buckets`)."""
        stats, device = self.stats, self.device
        stats.graph_captures = sum(d.captures for d in self.decs)
        stats.capture_s = sum(d.capture_s for d in self.decs)
        if self.prefill_events:
            if device.type == "cuda":
                self.prefill_events[-1][1].synchronize()
            stats.prefill_ms = sum(a.elapsed_time(b) if device.type == "cuda" else (b - a) * 1e3
                                   for a, b in self.prefill_events)
        if self.step_events:
            if device.type == "cuda":
                self.step_events[-1][5].synchronize()
            for b, live_rows, live_ctx, shared_ctx, ev0, ev1 in self.step_events:
                bt = stats.buckets.setdefault(b, BucketTime())
                bt.steps += 1
                bt.ms += ev0.elapsed_time(ev1) if device.type == "cuda" else (ev1 - ev0) * 1e3
                bt.live_rows += live_rows
                bt.live_kv_tokens += live_ctx
                bt.read_kv_tokens += shared_ctx
        stats.attention = self.dec.attention
